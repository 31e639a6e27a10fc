"""`streamer produce`: the rollout producer loop.

Per group: claim a row (a leased ticket) -> wait for an admission slot -> load the newest
policy version -> render -> sample G completions -> reward each -> publish one
TrajectoryGroup (the XADD and the end of the lease in one script) -> publish a rollout
MetricsEvent. A group with fewer than ``min_group_size`` good samples is dropped: its
slot is released and nothing is published. A heartbeat thread keeps ``…:producers``
fresh and renews the current lease.

Stops after ``max_groups`` published groups, when ``epochs`` are exhausted, or on
SIGTERM/SIGINT: the current row is finished if it can be within ``shutdown_grace``
seconds, otherwise handed back (requeued first) and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import redis

from producers.components import Task, build
from producers.dataset import Order
from producers.follow import WeightFollower
from producers.leases import EXHAUSTED, WAIT, Leases
from producers.rewards import score
from producers.samplers import SamplerError
from producers.stats import Pending, Timings, group_values
from schemas import MetricsEvent, Sample, TrajectoryGroup, encode
from streamer import lifecycle
from streamer.admission import Admission, LeaseLost
from streamer.bus import Publisher, connect, retrying, unacked
from streamer.config import RunConfig
from streamer.keys import Keys
from streamer.values import parse_int

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0  # well under the 5 s others treat as alive
MAX_SAMPLER_FAILURES = 10  # consecutive failed groups before the producer gives up


class Producer:
    """One producer: the loop of `streamer produce`, usable in-process by tests."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        client: redis.Redis,
        producer_id: str,
        task: Task,
        sampler,
        stop: threading.Event | None = None,
    ):
        self.cfg, self.p, self.client, self.id = cfg, cfg.producer, client, producer_id
        self.task, self.sampler = task, sampler
        self.keys = Keys(cfg.run.name)
        self.stop = stop or threading.Event()
        self.order = Order(len(task.rows), seed=cfg.run.seed)
        self.leases = Leases(
            client,
            self.keys,
            owner=producer_id,
            lease_seconds=self.p.lease_seconds,
            total_tickets=self.order.total_tickets(self.p.epochs),
            max_attempts=self.p.max_row_attempts,
        )
        t = cfg.trainer
        self.admission = Admission(
            client, self.keys, max_staleness=t.max_staleness, groups_per_step=t.groups_per_step
        )
        self.publisher = Publisher(client, self.keys, cfg.bus)
        self.follower = WeightFollower(client, self.keys, weights_dir=cfg.weights_dir, sampler=sampler)
        self.pending = Pending()
        self.current: int | None = None  # ticket being worked on (renewed by the heartbeat)
        self.published = 0
        self._failures = 0
        self._heartbeat = _Heartbeat(self, min(HEARTBEAT_SECONDS, self.p.lease_seconds / 3))

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Produce until done or stopped; 0 on a clean stop."""
        self._heartbeat.start()
        log.info(
            "producer %s: %d rows, G=%d, sampler %s, reward %s",
            self.id,
            len(self.task.rows),
            self.p.group_size,
            self.p.sampler,
            self.task.reward_path,
        )
        try:
            while not self.stop.is_set():
                if self.p.max_groups and self.published >= self.p.max_groups:
                    log.info("published %d groups (max_groups): done", self.published)
                    break
                # a server outage (restart, network) is waited out with logged backoff; the
                # row being worked on is handed back or its lease expires and it is re-issued
                if retrying(self.step, what=f"producer {self.id}") == "exhausted":
                    log.info("all %d epochs claimed and finished: done", self.p.epochs)
                    break
        finally:
            self._heartbeat.close()
            self._flush_metrics()
        return 0

    def step(self) -> str:
        """One claim: "published", "dropped", "lost", "stopped", "wait", "exhausted", "error"."""
        ticket = self.leases.claim()
        if ticket == EXHAUSTED:
            return "exhausted"
        if ticket == WAIT:  # open leases elsewhere may still expire and come back
            self.stop.wait(min(1.0, self.p.lease_seconds / 4))
            return "wait"
        self.current = ticket
        try:
            outcome = self._work(ticket)
        except SamplerError as e:
            self.leases.hand_back(ticket, error=f"sampler: {e}")
            return self._sampler_failed(e)
        except BaseException as e:
            try:  # the row's own failure counts towards skipping it; a server outage does not
                own = isinstance(e, Exception) and not isinstance(e, redis.exceptions.RedisError)
                self.leases.hand_back(ticket, error=f"{type(e).__name__}: {e}" if own else "")
            except redis.exceptions.RedisError as e:  # the lease will expire instead
                log.error("could not hand back ticket %d: %s", ticket, e)
            raise
        finally:
            self.current = None
        self._failures = 0
        return outcome

    def _work(self, ticket: int) -> str:
        pos = self.order.position(ticket)
        row = self.task.rows[pos.row]
        try:  # the slot is the lease's (atomically: a retried admission takes no second one)
            admission_wait = self.admission.wait(self.stop.is_set, ticket=ticket, owner=self.id)
        except LeaseLost:
            log.warning("lease on ticket %d expired while waiting for admission", ticket)
            return "lost"
        if admission_wait is None:
            self.leases.hand_back(ticket)
            return "stopped"
        self._follow_weights()
        created, start = time.time(), time.monotonic()
        try:
            prompt = self.task.renderer.render(row)
        except (ValueError, KeyError, TypeError) as e:
            log.error("row %d cannot be rendered (%s); skipped", pos.row, e)
            return self._drop(ticket, failures=0)
        version = self.follower.version
        completions = self.sampler.sample(
            prompt,
            n=self.p.group_size,
            temperature=self.p.temperature,
            top_p=self.p.top_p,
            max_new_tokens=self.p.max_new_tokens,
            seed=_seed(self.cfg.run.seed, ticket),
        )
        sample_seconds = time.monotonic() - start
        samples = [s for c in completions if (s := self._score(row, prompt, c, version)) is not None]
        failures = len(completions) - len(samples)
        if len(samples) < self.p.min_group_size:
            log.warning(
                "row %d: %d good samples < min_group_size %d; group dropped",
                pos.row,
                len(samples),
                self.p.min_group_size,
            )
            return self._drop(ticket, failures=failures)
        group = TrajectoryGroup(
            group_id=f"{pos.epoch}:{pos.row}",
            row=pos.row,
            epoch=pos.epoch,
            producer_id=self.id,
            samples=samples,
            policy_version=min(s.version for s in samples),
            created_at=created,
        )
        timings = Timings(sample_seconds, admission_wait, 0.0)
        return self._publish(ticket, group, failures=failures, timings=timings)

    def _score(self, row: dict, prompt: list[int], completion, version: int) -> Sample | None:
        if not completion.token_ids:
            return None
        try:
            text = self.task.renderer.decode(completion.token_ids)
            reward = score(self.task.reward_fn, row, text, completion)
        except Exception as e:  # a user function: anything it raises marks the sample failed
            log.warning(
                "reward %s raised %s: %s (sample dropped)", self.task.reward_path, type(e).__name__, e
            )
            return None
        return Sample.build(
            prompt_ids=prompt,
            completion_ids=completion.token_ids,
            logprobs=completion.logprobs,
            reward=reward,
            finish_reason=completion.finish_reason,
            version=version,
        )

    def _publish(self, ticket: int, group: TrajectoryGroup, *, failures: int, timings: Timings) -> str:
        waited = self.publisher.wait_for_room(self.stop.is_set)
        if self.stop.is_set() and unacked(self.client, self.keys.traj) >= self.cfg.bus.max_unacked:
            self.leases.hand_back(ticket)  # stopping and no room: someone else publishes it later
            return "stopped"
        if self.leases.publish(ticket, encode(group)) is None:
            log.warning("lease on row %d (epoch %d) was lost; group discarded", group.row, group.epoch)
            return "lost"
        self.published += 1
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(self.keys.rollout_step)
        pipe.get(self.keys.version)
        step, current = pipe.execute()
        timings = Timings(timings.sample_seconds, timings.admission_wait_seconds, waited)
        current = parse_int(current, self.keys.version, default=0)
        values = group_values(group, failures=failures, current_version=current, timings=timings)
        self._send_metrics(parse_int(step, self.keys.rollout_step), values)
        return "published"

    def _drop(self, ticket: int, *, failures: int) -> str:
        self.leases.finish(ticket)  # the row is done for this epoch; its slot goes back
        self.pending.add("groups_dropped")
        self.pending.add("sample_failures", failures)
        self._flush_metrics()
        return "dropped"

    def _sampler_failed(self, e: SamplerError) -> str:
        self._failures += 1
        log.error("sampling failed (%d in a row): %s; row handed back", self._failures, e)
        if self._failures >= MAX_SAMPLER_FAILURES:
            raise SamplerError(f"{self._failures} groups in a row failed to sample; last: {e}")
        self.stop.wait(min(30.0, 0.5 * 2**self._failures))
        return "error"

    # ------------------------------------------------------------ weights and metrics

    def _follow_weights(self) -> None:
        loads, errors = self.follower.loads, self.follower.errors
        if self.follower.update():
            self.pending.weight_load_seconds = self.follower.last_load_seconds
        self.pending.add("weight_loads", self.follower.loads - loads)
        self.pending.add("weight_load_errors", self.follower.errors - errors)

    def _send_metrics(self, step: int, values: dict[str, float]) -> None:
        pending = self.pending.drain()
        values = {**values, **{k: values.get(k, 0.0) + v for k, v in pending.items()}}
        event = MetricsEvent(axis="rollout", step=step, values=values, source=f"producer-{self.id}")
        self.publisher.publish(self.keys.metrics, event)

    def _flush_metrics(self) -> None:
        """Publish pending counters now (at the current rollout step, not a new one)."""
        if not self.pending:
            return
        try:
            step = int(self.client.get(self.keys.rollout_step) or 0)
            self._send_metrics(step, {})
        except redis.exceptions.RedisError as e:
            log.warning("could not publish pending rollout counters: %s", e)

    def close(self) -> None:
        self.sampler.close()


class _Heartbeat(threading.Thread):
    """ZADD ``…:producers`` {id: now} and renew the current lease every ``interval`` s."""

    def __init__(self, producer: Producer, interval: float):
        super().__init__(name=f"heartbeat-{producer.id}", daemon=True)
        self.producer, self.interval = producer, interval
        self._done = threading.Event()

    def run(self) -> None:
        p = self.producer
        while True:
            try:
                p.client.zadd(p.keys.producers, {p.id: time.time()})
                ticket = p.current
                if ticket is not None and not p.leases.renew(ticket):
                    # usually the lease just ended (published); a real loss is logged where
                    # it matters, when the group cannot be published
                    log.debug("lease on ticket %d is no longer ours", ticket)
            except redis.exceptions.RedisError as e:
                log.warning("heartbeat failed: %s", e)
            if self._done.wait(self.interval):
                return

    def close(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(timeout=5.0)
        try:
            self.producer.client.zrem(self.producer.keys.producers, self.producer.id)
        except redis.exceptions.RedisError as e:
            log.warning("could not remove heartbeat: %s", e)


def _seed(base: int, ticket: int) -> int:
    """A sampling seed per (run seed, ticket): reruns sample the same completions."""
    return (base * 1_000_003 + ticket) % (2**31 - 1)


# ---------------------------------------------------------------- entry point


def main(cfg: RunConfig, args) -> int:
    producer_id = getattr(args, "id", None) or f"{socket.gethostname()}-{os.getpid()}"
    client = connect(
        cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name=f"producer-{producer_id}"
    )
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id=producer_id, task=task, sampler=sampler)
    _install_signals(producer)
    try:
        return producer.run()
    finally:
        producer.close()
        client.close()


def _install_signals(producer: Producer) -> None:
    """SIGTERM/SIGINT: stop after the current row; past the grace period, hand it back."""

    def on_signal(signum, _frame):
        if producer.stop.is_set():
            return
        log.info(
            "%s: finishing the current row (grace %.0fs)",
            signal.Signals(signum).name,
            producer.p.shutdown_grace,
        )
        producer.stop.set()
        lifecycle.exit_if_orphaned(f"producer {producer.id}")
        timer = threading.Timer(producer.p.shutdown_grace, _give_up, args=(producer,))
        timer.daemon = True  # a loop that ends in time exits without waiting for it
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _give_up(producer: Producer) -> None:
    """The grace period passed: hand the row back and leave now (exit 0: a clean stop)."""
    ticket = producer.current
    try:
        if ticket is not None and producer.leases.hand_back(ticket):
            log.warning("grace period over: ticket %d handed back", ticket)
        producer.client.zrem(producer.keys.producers, producer.id)
    except redis.exceptions.RedisError as e:
        log.error("grace period over; could not hand back ticket %s: %s", ticket, e)
    logging.shutdown()
    os._exit(0)
