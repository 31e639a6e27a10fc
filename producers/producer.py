"""`streamer produce`: the rollout producer loop.

Per row: claim it (a leased ticket) and its admission slot (waiting for one if the window
is full) -> load the newest policy version -> run the rollout function
(``producer.rollout``; the default renders, samples G completions and rewards each) ->
check every episode -> publish one TrajectoryGroup with its rollout MetricsEvent (the XADDs
and the end of the lease in one script). Two round trips per row (producers/trips.py);
rows whose groups teach nothing are set aside (streamer/rows.py), and when none is left
that can teach the producer stops. ``producer.concurrency`` rows are in flight at once
(anyio tasks), each with its own lease and admission slot; blocking calls run in worker threads (Redis calls
run on the event loop when one row at a time samples an in-process model). A group
with fewer than ``min_group_size`` good episodes is dropped: its slot is released and
nothing is published. A rollout that raises or outlives ``rollout_timeout`` hands its row
back; after ``producer.max_row_attempts`` failed attempts (counted on the server, by any
producer, an expired lease included) the row is skipped with its last error. A
heartbeat thread keeps ``…:producers`` fresh and renews every lease held.

Stops after ``max_groups`` published groups, when ``epochs`` are exhausted, or on
SIGTERM/SIGINT: rows in flight are finished if they can be within ``shutdown_grace``
seconds, otherwise handed back (requeued first) and the process exits 0.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import socket
import threading
import time

import anyio
import redis

from producers.components import build, load_rollout
from producers.dataset import Order
from producers.episodes import claimed_version, to_samples
from producers.follow import WeightFollower
from producers.heartbeat import Heartbeat
from producers.inflight import WeightGate, blocking, retrying
from producers.samplers import SamplerError
from producers.stats import Pending, Timings, episode_values, group_values
from producers.trips import Trips
from schemas import MetricsEvent, TrajectoryGroup
from streamer import connection, lifecycle, problems
from streamer.admission import AGAIN, EXHAUSTED, NOTHING_TO_TEACH, WAIT, Admission, LeaseLost, Leases
from streamer.bus import Publisher
from streamer.config import RunConfig
from streamer.connection import TRANSIENT, connect, replicated
from streamer.errors import EpisodeRejected, StreamerError, WeightsError
from streamer.keys import Keys
from streamer.rollout.batching import MicroBatcher
from streamer.rollout.contract import DEFAULT_ROLLOUT, Completion, Episode, RolloutContext, Task
from streamer.rollout.trajectory import PrefixMismatch
from streamer.values import check_types, parse_int

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0  # well under the 5 s others treat as alive
MAX_SAMPLER_FAILURES = 10  # rows in a row refused by the engine before the producer gives up
SYSTEMIC_ROWS = 3  # different rows failing the same way in a row: the engine's or the weights' fault


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
        rollout=None,
    ):
        self.cfg, self.producer_cfg, self.client, self.id = cfg, cfg.producer, client, producer_id
        self.task, self.sampler = task, sampler
        self.rollout = rollout or load_rollout(
            self.producer_cfg.rollout,
            max_reply_bytes=self.producer_cfg.max_reply_bytes,
            timeout=self.producer_cfg.rollout_timeout,
        )
        self.rollout_path = self.producer_cfg.rollout or DEFAULT_ROLLOUT
        self.keys = Keys(cfg.run.name)
        self.stop = stop or threading.Event()
        self.order = Order(len(task.rows), seed=cfg.run.seed)
        self.leases = Leases(
            client,
            self.keys,
            owner=producer_id,
            lease_seconds=self.producer_cfg.lease_seconds,
            total_tickets=self.order.total_tickets(self.producer_cfg.epochs),
            max_attempts=self.producer_cfg.max_row_attempts,
            defer_after=self.producer_cfg.defer_after,
            revisit_probability=self.producer_cfg.revisit_probability,
            n_rows=len(task.rows),
        )
        t = cfg.trainer
        self.admission = Admission(
            client, self.keys, max_staleness=t.max_staleness, groups_per_step=t.groups_per_step
        )
        self.publisher = Publisher(client, self.keys, cfg.bus)
        self.follower = WeightFollower(
            client,
            self.keys,
            weights_dir=cfg.weights_dir,
            sampler=sampler,
            verify=cfg.weights.verify,
            who=f"producer {producer_id}",
        )
        self.vocab_size = _vocab_size(task, sampler)
        self.pending = Pending()
        self.held: set[int] = set()  # tickets being worked on (renewed by the heartbeat)
        self.published = 0
        self._counting = threading.Lock()  # publishes may finish in worker threads
        self.in_flight = 0  # rows between claim and publish/drop/hand-back
        self._failures = 0
        self._streak: list[tuple[str, int, int]] = []  # (failure, ticket, row) failed since a success
        self._who, self._problem = f"producer {producer_id}", False  # in status's problems
        self._newest = 0  # the newest policy version published, as last read
        self.trips = Trips(
            client,
            self.keys,
            leases=self.leases,
            admission=self.admission,
            order=self.order,
            tail=self.follower.tail,
            pending=self.pending,
            publisher=self.publisher,
            source=f"producer-{producer_id}",
        )
        self._nothing_to_teach = False
        self._gate: WeightGate | None = None
        self._heartbeat = Heartbeat(self, min(HEARTBEAT_SECONDS, self.producer_cfg.lease_seconds / 3))

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Produce until done or stopped; 0 on a clean stop."""
        self.client.set(self.keys.row_count, len(self.task.rows))  # for `streamer status`
        self._heartbeat.start()
        try:
            self.wait_for_engine()
        except BaseException:
            self._heartbeat.close()
            raise
        log.info(
            "producer %s: %d rows, G=%d, %d in flight, sampler %s, rollout %s, reward %s",
            self.id,
            len(self.task.rows),
            self.producer_cfg.group_size,
            self.producer_cfg.concurrency,
            self.producer_cfg.sampler,
            self.rollout_path,
            self.task.reward_path,
        )
        try:
            anyio.run(self._run)
        except BaseExceptionGroup as group:  # a worker's clear error: one line, not a group
            # a key overwritten with another type while running: the CLI's one line too
            if isinstance(leaf := _first_leaf(group), (StreamerError, redis.exceptions.ResponseError)):
                raise leaf from group
            raise
        finally:
            self._heartbeat.close()
            self._flush_metrics()
        return 0

    def wait_for_engine(self, *, log_every: float = 30.0) -> None:
        """A remote engine: wait until it completes a first request (it may still be starting,
        or be down), reported as a problem meanwhile; one that answers with an error (a
        model it refuses) stops the producer here, with the engine's reason, before any row."""
        probe = getattr(self.sampler, "probe", None)
        if probe is None:
            return
        prompt = self.task.renderer.render(self.task.rows[0]) if self.task.rows else [0]
        waited, last_log, delay = 0.0, -log_every, 0.5
        while not self.stop.is_set():
            try:
                probe(prompt)
            except SamplerError as e:
                if e.refused:
                    problems.report(self.client, self.keys, self._who, str(e))
                    raise
                if waited - last_log >= log_every:
                    log.warning("waiting for the engine (%.0fs so far): %s", waited, e)
                    last_log = waited
                problems.report(self.client, self.keys, self._who, f"engine unreachable: {e}")
                self._problem = True
                self.stop.wait(delay)
                waited += delay
                delay = min(5.0, delay * 2)
                continue
            if self._problem:
                problems.clear(self.client, self.keys, self._who)
                self._problem = False
            log.info("engine %s answers", getattr(self.sampler, "base_url", ""))
            return

    async def _run(self) -> None:
        self._setup()
        async with anyio.create_task_group() as tg:
            for _ in range(self.producer_cfg.concurrency):
                tg.start_soon(self._worker)

    def _setup(self) -> None:
        """Per event loop: the weight gate and the thread limiters."""
        self._gate = WeightGate(exclusive=getattr(self.sampler, "max_parallel", 1) == 1)
        self._redis_limiter = anyio.CapacityLimiter(self.producer_cfg.concurrency + 2)
        self._sample_limiter = anyio.CapacityLimiter(getattr(self.sampler, "max_parallel", 1))
        self._reward_limiter = anyio.CapacityLimiter(self.cfg.reward.concurrency)
        local = getattr(self.sampler, "max_parallel", 1) == 1 and hasattr(self.sampler, "sample_many")
        self._batcher = MicroBatcher(self._sample_batch) if local else None
        # one row at a time on an in-process model: while a Redis call runs, the loop has
        # nothing else to do, so it runs there; a thread hop costs more CPU than the call
        self._inline_redis = local and self.producer_cfg.concurrency == 1

    async def _worker(self) -> None:
        while not self.stop.is_set():
            if (
                self.producer_cfg.max_groups
                and self.published + self.in_flight >= self.producer_cfg.max_groups
            ):
                if self.published >= self.producer_cfg.max_groups:
                    log.info("published %d groups (max_groups): done", self.published)
                    return
                await anyio.sleep(0.05)  # the rows in flight may still fail and need redoing
                continue
            # a server outage (restart, network) is waited out with logged backoff; the
            # row being worked on is handed back or its lease expires and it is re-issued
            outcome = await retrying(self._step, what=f"producer {self.id}")
            if outcome == "exhausted":
                log.info("all %d epochs claimed and finished: done", self.producer_cfg.epochs)
                return
            if outcome == "nothing to teach":
                return

    def step(self) -> str:
        """One row, start to end (tests): the outcome of :meth:`_step`."""

        async def one() -> str:
            self._setup()
            return await self._step()

        return anyio.run(one)

    async def _step(self) -> str:
        """One claim: "published", "dropped", "lost", "stopped", "wait", "exhausted", "error",
        "failed" (the rollout raised or timed out; the row was handed back), "again" (claim
        again with a new window of rows), "nothing to teach" (every row is solved)."""
        self.in_flight += 1
        try:
            claim = await self._redis(self.trips.claim)
            ticket = claim.ticket
            if ticket == EXHAUSTED:
                return "exhausted"
            if ticket == WAIT:  # open leases elsewhere may still expire and come back
                await anyio.sleep(min(1.0, self.producer_cfg.lease_seconds / 4))
                return "wait"
            if ticket == AGAIN:
                return "again"
            if ticket == NOTHING_TO_TEACH:
                await self._redis(self._stop_teaching)
                return "nothing to teach"
            self.held.add(ticket)
            try:
                outcome = await self._work(ticket, granted=claim.granted)
            except SamplerError as e:  # an attempt only if the engine refused this request
                self._hand_back(ticket, error=f"sampler: {e}" if e.refused else "")
                return await self._sampler_failed(e)
            except BaseException as e:
                # the row's own failure counts towards skipping it; a server outage does not
                own = isinstance(e, Exception) and not isinstance(
                    e, redis.exceptions.RedisError | WeightsError
                )
                self._hand_back(ticket, error=f"{type(e).__name__}: {e}" if own else "")
                raise
            finally:
                self.held.discard(ticket)
        finally:
            self.in_flight -= 1
        if outcome != "failed":
            self._failures = 0
        if outcome == "published":
            self._streak.clear()
        if outcome == "published" and self._problem:
            self._problem = False
            await self._redis(problems.clear, self.client, self.keys, self._who)
        return outcome

    def _stop_teaching(self) -> None:
        """Every row is solved: say so once (log, metric) and stop sampling."""
        if self._nothing_to_teach:
            return
        self._nothing_to_teach = True
        r = self.trips.rows
        log.info(
            "every row is solved (%d of %d): nothing left to teach; producer stopping", r.solved, r.total
        )
        step = parse_int(self.client.get(self.keys.rollout_step), self.keys.rollout_step, default=0)
        self._send_metrics(step, {"nothing_to_teach": 1.0, **self.trips.gauges()})

    async def _work(self, ticket: int, *, granted: bool = False) -> str:
        pos = self.order.position(ticket)
        row = copy.deepcopy(self.task.rows[pos.row])  # a rollout that edits its row changes no later epoch
        try:  # the slot is the lease's (atomically: a retried admission takes no second one)
            admission_wait = 0.0
            if not granted:
                admission_wait = await self._redis(
                    self.admission.wait, self.stop.is_set, ticket=ticket, owner=self.id
                )
                self.trips.fresh = False  # a new version may have opened the window
        except LeaseLost:
            log.warning("lease on ticket %d expired while waiting for admission", ticket)
            return "lost"
        if admission_wait is None:
            self._hand_back(ticket)
            return "stopped"
        created, start = time.time(), time.monotonic()
        episodes = await self._rollout(row, pos, ticket)
        if episodes is None:
            return "failed"
        sample_seconds = time.monotonic() - start
        samples = self._check(episodes, pos, await self._newest_version(episodes))
        failures = max(0, self.producer_cfg.group_size - len(samples))
        if len(samples) < self.producer_cfg.min_group_size:
            log.warning(
                "row %d: %d good samples < min_group_size %d; group dropped",
                pos.row,
                len(samples),
                self.producer_cfg.min_group_size,
            )
            return await self._drop(ticket, failures=failures)
        group = TrajectoryGroup(
            group_id=f"{pos.epoch}:{pos.row}",
            row=pos.row,
            epoch=pos.epoch,
            producer_id=self.id,
            samples=[s for pieces, _ in samples for s in pieces],  # an episode's forks: several
            policy_version=min(s.version for pieces, _ in samples for s in pieces),  # the oldest turn
            created_at=created,
        )
        timings = Timings(sample_seconds, admission_wait, 0.0)
        extra = episode_values([e for _, e in samples], seconds=sample_seconds, in_flight=self.in_flight)
        return await self._publish(ticket, group, failures=failures, timings=timings, extra=extra)

    async def _rollout(self, row: dict, pos, ticket: int) -> list[Episode] | None:
        """The rollout's episodes, or None (counted, logged, row handed back) when it failed."""
        ctx = RolloutContext(
            task=self.task,
            group_size=self.producer_cfg.group_size,
            temperature=self.producer_cfg.temperature,
            top_p=self.producer_cfg.top_p,
            max_new_tokens=self.producer_cfg.max_new_tokens,
            seed=_seed(self.cfg.run.seed, ticket),
            sample_fn=self._sample,
            max_seq_len=self.cfg.trainer.max_seq_len,
            reward_limiter=self._reward_limiter,
            reward_timeout=self.cfg.reward.timeout,
        )
        where = f"row {pos.row} (epoch {pos.epoch})"
        try:
            with anyio.fail_after(self.producer_cfg.rollout_timeout or None):
                return list(await self.rollout(row, ctx))
        except Exception as e:  # user code: anything it raises drops the rollout, not the producer
            leaf = _first_leaf(e)
            if isinstance(leaf, (SamplerError, WeightsError, *TRANSIENT)):  # the engine's or the server's
                raise leaf from e
            if isinstance(leaf, TimeoutError):
                reason, why = "timeout", f"timed out after {self.producer_cfg.rollout_timeout:.1f}s"
                if str(leaf):
                    why = f"timed out: {leaf}"
            elif isinstance(leaf, EpisodeRejected):  # e.g. a service's bad reply
                reason, why = leaf.reason, str(leaf)
            else:
                reason, why = "error", f"raised {type(leaf).__name__}: {leaf}"
            if isinstance(leaf, PrefixMismatch):
                self.pending.add("prefix_mismatches")
        self.pending.add(f"episodes_dropped_{reason}", self.producer_cfg.group_size)
        if self._systemic(why, ticket, pos.row):  # not the rows' fault: no attempt counted
            what = f"every row fails the same way ({len(self._streak)} rollouts in a row): rollout {why}"
            log.error("%s; not counted against the rows (engine or weights?), backing off", what)
            self._hand_back(ticket)
            problems.report(self.client, self.keys, self._who, what)
            self._problem = True
            await self._backoff(min(30.0, 0.5 * 2 ** min(len(self._streak) - SYSTEMIC_ROWS, 6)))
            return None
        # counted on the server per row (streamer/admission.py): after producer.max_row_attempts
        # failed attempts, by any producer, the next claim skips the row with this reason
        log.error("%s: rollout %s %s; row handed back", where, self.rollout_path, why)
        self._hand_back(ticket, error=f"rollout {why}")
        return None

    def _systemic(self, why: str, ticket: int, row: int) -> bool:
        """Whether the rollouts failed since the last success all failed the same way (numbers
        aside) on SYSTEMIC_ROWS different rows or more: a failure every row shares is not the
        rows' fault. The first time it shows, the attempts it charged are forgiven (a row
        skipped for them is handed out again)."""
        key = re.sub(r"\d+", "#", why)[:200]
        if self._streak and self._streak[-1][0] != key:
            self._streak = []
        before = len({r for _, _, r in self._streak})
        self._streak = [*self._streak[-50:], (key, ticket, row)]
        if len({r for _, _, r in self._streak}) < SYSTEMIC_ROWS:
            return False
        if before < SYSTEMIC_ROWS:  # it shows now
            unskipped = self.leases.forgive(t for _, t, _ in self._streak)
            log.warning(
                "forgave the failed attempts of %d rows (%d had been skipped)", len(self._streak), unskipped
            )
        return True

    async def _newest_version(self, episodes: list) -> int:
        """The newest version published: read again only when an episode claims a newer one
        than last read (a rollout service's engine may follow the policy ahead of this producer)."""
        if claimed_version(episodes) > max(self._newest, self.follower.version):
            latest = await self._redis(self.client.get, self.keys.version)
            self._newest = max(self._newest, parse_int(latest, self.keys.version, default=0))
        return max(self._newest, self.follower.version)

    def _check(self, episodes: list, pos, newest: int) -> list[tuple]:
        """(samples, Episode) of every episode that passes :func:`producers.episodes.to_samples`."""
        out = []
        for i, e in enumerate(episodes[: self.producer_cfg.group_size]):
            try:
                samples = to_samples(
                    e,
                    vocab_size=self.vocab_size,
                    max_seq_len=self.cfg.trainer.max_seq_len,
                    max_version=newest,
                    index=i,
                )
                out.append((samples, e))
            except EpisodeRejected as err:
                self.pending.add(f"episodes_dropped_{err.reason}")
                log.warning("row %d (epoch %d): episode dropped: %s", pos.row, pos.epoch, err)
        return out

    async def _sample(self, prompt_ids: list[int], **kwargs) -> list[Completion]:
        """The rollout's engine call: in a thread, stamped with the version that sampled it.

        A newer policy is loaded first, so the turns of one episode may differ in version.
        Calls on an in-process model are batched with the other episodes' (MicroBatcher)."""
        if self._batcher is not None:
            return await self._batcher.sample(prompt_ids, **kwargs)
        await self._follow_weights()
        async with self._gate.reading():
            version = self.follower.version
            completions = await blocking(
                self.sampler.sample, prompt_ids, limiter=self._sample_limiter, **kwargs
            )
        return [dataclasses.replace(c, version=version) for c in completions]

    async def _sample_batch(self, prompts: list[list[int]], **kwargs) -> list[list[Completion]]:
        """One batched generate of an in-process model, stamped with its version."""
        await self._follow_weights()
        async with self._gate.reading():
            version = self.follower.version
            out = await blocking(self.sampler.sample_many, prompts, limiter=self._sample_limiter, **kwargs)
        return [[dataclasses.replace(c, version=version) for c in cs] for cs in out]

    async def _publish(self, ticket: int, group: TrajectoryGroup, *, failures, timings, extra) -> str:
        """The room check, the group, the row's record and its metrics event: one script
        (:mod:`producers.trips`), in one :meth:`_redis` call with the rare waits."""

        def values(waited: float) -> dict[str, float]:
            t = Timings(timings.sample_seconds, timings.admission_wait_seconds, waited)
            return {**group_values(group, failures=failures, current_version=0, timings=t), **extra}

        def publish() -> str:
            bus = self.cfg.bus
            published = self.trips.publish(ticket, group, values, stop=self.stop, max_unacked=bus.max_unacked)
            if published == "stopped":
                self._hand_back(ticket)  # stopping and no room: someone else publishes it later
                return "stopped"
            if published is None:
                log.warning("lease on row %d (epoch %d) was lost; group discarded", group.row, group.epoch)
                return "lost"
            # with bus.min_replicas, published means on a replica: if the master dies first, the
            # error redoes the step (the row comes back when its lease expires, if the group is gone)
            replicated(self.client, self.keys.replicated, bus)
            with self._counting:
                self.published += 1
            return "published"

        return await self._redis(publish)

    async def _drop(self, ticket: int, *, failures: int) -> str:
        await self._redis(self.leases.finish, ticket)  # the row is done for this epoch; its slot goes back
        self.pending.add("groups_dropped")
        self.pending.add("sample_failures", failures)
        await self._redis(self._flush_metrics)
        return "dropped"

    async def _sampler_failed(self, e: SamplerError) -> str:
        """Back off after a failed engine call. An engine that cannot be reached (or answers
        5xx) is an outage, waited out for as long as it lasts and named in `status`; one that
        refuses request after request (4xx) is not going to serve this producer: it stops."""
        self._failures += 1
        if e.refused:
            log.error("the engine refused a request (%d in a row): %s; row handed back", self._failures, e)
            if self._failures >= MAX_SAMPLER_FAILURES:
                raise SamplerError(f"{self._failures} rows in a row were refused by the engine; last: {e}")
        else:
            log.error("engine unreachable (%d tries): %s; row handed back, waiting", self._failures, e)
            problems.report(self.client, self.keys, self._who, f"engine down: {e}")
            self._problem = True
        await self._backoff(min(30.0, 0.5 * 2 ** min(self._failures, 6)))
        return "error"

    async def _backoff(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            while not self.stop.is_set():
                await anyio.sleep(0.05)

    def _hand_back(self, ticket: int, error: str = "") -> None:
        try:
            self.leases.hand_back(ticket, error=error)
        except redis.exceptions.RedisError as e:  # the lease will expire instead
            log.error("could not hand back ticket %d: %s", ticket, e)

    async def _redis(self, fn, *args, **kwargs):
        if self._inline_redis:
            return fn(*args, **kwargs)
        return await blocking(fn, *args, limiter=self._redis_limiter, **kwargs)

    # ------------------------------------------------------------ weights and metrics

    async def _follow_weights(self) -> None:
        """Load a newer version, once no engine call is in flight (see WeightGate)."""
        fresh, sync = self.trips.policy_news()  # what the claim just said: no round trip of its own
        if not fresh:
            sync = await self._redis(self.trips.read_policy)
        f = self.follower
        if not f.due(sync):
            return
        async with self._gate.writing():
            if not f.due(sync):
                return  # another worker loaded it while we waited
            errors = f.errors
            if await blocking(f.load, sync):
                self.pending.weight_load_seconds = f.last_load_seconds
                self.pending.add("weight_loads")
            self.pending.add("weight_load_errors", f.errors - errors)

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


def _first_leaf(e: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: what an episode really raised."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _vocab_size(task: Task, sampler) -> int:
    """Token ids at or above this are malformed: the larger of tokenizer and model vocab."""
    n = len(task.renderer.tokenizer)
    model = getattr(sampler, "model", None)
    return max(n, int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0))


def _seed(base: int, ticket: int) -> int:
    """A sampling seed per (run seed, ticket): reruns sample the same completions."""
    return (base * 1_000_003 + ticket) % (2**31 - 1)


# ---------------------------------------------------------------- entry point


def main(cfg: RunConfig, args) -> int:
    producer_id = getattr(args, "id", None) or f"{socket.gethostname()}-{os.getpid()}"
    client = connect(
        cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name=f"producer-{producer_id}"
    )
    # a key of the wrong type (a string where the run keeps a stream): one line, now
    connection.retrying(
        lambda: check_types(client, Keys(cfg.run.name).types()), what="checking the run's keys"
    )
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id=producer_id, task=task, sampler=sampler)
    previous = _install_signals(producer)
    try:
        return producer.run()
    finally:
        lifecycle.restore_signals(previous)
        producer.close()
        client.close()


def _install_signals(producer: Producer) -> dict:
    """SIGTERM/SIGINT: stop after the current rows; past the grace period, hand them back.
    A second signal stops at once (streamer.lifecycle's rule): the leases expire instead."""
    grace = producer.producer_cfg.shutdown_grace

    def arm_grace() -> None:
        timer = threading.Timer(grace, _give_up, args=(producer,))
        timer.daemon = True  # a loop that ends in time exits without waiting for it
        timer.start()

    doing = f"finishing the current row (grace {grace:.0f}s)"
    return lifecycle.on_stop_signals(producer.stop, f"producer {producer.id}", doing, then=arm_grace)


def _give_up(producer: Producer) -> None:
    """The grace period passed: hand the rows back and leave now (exit 0: a clean stop)."""
    held = sorted(producer.held)
    try:
        for ticket in held:
            if producer.leases.hand_back(ticket):
                log.warning("grace period over: ticket %d handed back", ticket)
        producer.client.zrem(producer.keys.producers, producer.id)
    except redis.exceptions.RedisError as e:
        log.error("grace period over; could not hand back tickets %s: %s", held, e)
    logging.shutdown()
    os._exit(0)
