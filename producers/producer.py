"""`streamer produce`: the rollout producer loop.

Per row: claim it (a leased ticket) and its admission slot (waiting for one if the window
is full) -> load the newest policy version -> run the rollout function
(``producer.rollout``; the default renders, samples G completions and rewards each) ->
check every episode (producers/episodes.py) -> publish one TrajectoryGroup with its rollout
MetricsEvent (the XADDs and the end of the lease in one script). Two round trips per row
(producers/trips.py); rows whose groups teach nothing are set aside (streamer/rows.py), and
when none is left that can teach the producer stops. ``producer.concurrency`` rows are in
flight at once (anyio tasks), each with its own lease and admission slot; how they reach
the server and the engine is chosen once, from the sampler (producers/transport.py). A
group with fewer than ``min_group_size`` good episodes is dropped: its slot is released and
nothing is published. A rollout that raises or outlives ``rollout_timeout`` hands its row
back; after ``producer.max_row_attempts`` failed attempts (counted on the server, by any
producer, an expired lease included) the row is skipped with its last error. An engine
outage, or a failure every row shares, is waited out and charged to no row
(producers/outages.py). A heartbeat thread keeps ``…:producers`` fresh and renews every
lease held.

Stops after ``max_groups`` published groups, when ``epochs`` are exhausted, or on
SIGTERM/SIGINT (producers/shutdown.py): rows in flight are finished if they can be within
``shutdown_grace`` seconds, otherwise handed back (requeued first) and the process exits 0.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import socket
import threading
import time

import anyio
import redis

from producers import rewards, shutdown
from producers.components import build, load_rollout
from producers.episodes import check_group, claimed_version, vocab_size
from producers.follow import WeightFollower
from producers.heartbeat import Heartbeat
from producers.inflight import first_leaf, retrying
from producers.mix import order_of
from producers.outages import Outages, rollout_failure
from producers.samplers import SamplerError
from producers.stats import Pending, episode_values, group_values
from producers.transport import Transport
from producers.trips import Outcome, Trips
from schemas import TrajectoryGroup
from streamer import connection, lifecycle, rows
from streamer.admission import AGAIN, EXHAUSTED, NOTHING_TO_TEACH, WAIT, LeaseLost
from streamer.config import RunConfig
from streamer.connection import connect
from streamer.errors import StreamerError, WeightsError
from streamer.keys import Keys
from streamer.rollout.contract import DEFAULT_ROLLOUT, Episode, RolloutContext, Task
from streamer.rollout.trajectory import PrefixMismatch
from streamer.values import check_types, parse_int

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0  # well under the 5 s others treat as alive


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
        self.order = order_of(task.rows, seed=cfg.run.seed)  # weighted when several sources
        self.follower = WeightFollower.of_run(cfg, client, sampler, who=f"producer {producer_id}")
        self.vocab_size = vocab_size(task.renderer.tokenizer, sampler)
        self.pending = Pending()
        self.held: set[int] = set()  # tickets being worked on (renewed by the heartbeat)
        self.published = 0
        self.in_flight = 0  # rows between claim and publish/drop/hand-back
        self._newest = 0  # the newest policy version published, as last read
        self.trips = Trips(
            cfg,
            client,
            producer_id=producer_id,
            order=self.order,
            tail=self.follower.tail,
            pending=self.pending,
        )
        self.leases, self.admission = self.trips.leases, self.trips.admission
        self.transport = Transport(
            sampler,
            follower=self.follower,
            trips=self.trips,
            concurrency=self.producer_cfg.concurrency,
            reward_concurrency=cfg.reward.concurrency,
            alone=rollout is None
            and self.producer_cfg.rollout in ("", DEFAULT_ROLLOUT)
            and not self.producer_cfg.rollout_timeout,
        )
        self.outages = Outages(client, self.keys, self.leases, stop=self.stop, who=f"producer {producer_id}")
        self._heartbeat = Heartbeat(self, min(HEARTBEAT_SECONDS, self.producer_cfg.lease_seconds / 3))

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Produce until done or stopped; 0 on a clean stop."""
        self.client.set(self.keys.row_count, len(self.task.rows))  # for `streamer status`
        brought_back, changed = rows.settle_settings(self.client, self.keys, rows.outcome_settings(self.cfg))
        if changed:
            log.warning(
                "the settings rows were judged under changed (%s): every row record is forgotten, "
                "%d rows set aside are active again",
                "; ".join(changed),
                brought_back,
            )
        self._heartbeat.start()
        try:
            self.outages.wait_for_engine(self.sampler, self.task)
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
            if isinstance(leaf := first_leaf(group), (StreamerError, redis.exceptions.ResponseError)):
                raise leaf from group
            raise
        finally:
            self._heartbeat.close()
            self.trips.flush_metrics()
        return 0

    async def _run(self) -> None:
        self.transport.start()
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.producer_cfg.concurrency):
                    tg.start_soon(self._worker)
        finally:  # what the reward holds in this loop (a judge's HTTP client) ends with it
            await rewards.close(self.task.reward_fn)

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
            if outcome is Outcome.EXHAUSTED:
                log.info("all %d epochs claimed and finished: done", self.producer_cfg.epochs)
                return
            if outcome is Outcome.NOTHING_TO_TEACH:
                return

    def step(self) -> Outcome:
        """One claim, start to end (tests)."""

        async def one() -> Outcome:
            self.transport.start()
            try:
                return await self._step()
            finally:
                await rewards.close(self.task.reward_fn)

        return anyio.run(one)

    async def _step(self) -> Outcome:
        self.in_flight += 1
        try:
            claim = await self.transport.redis(self.trips.claim)
            ticket = claim.ticket
            if ticket == EXHAUSTED:
                await self.transport.redis(self.trips.exhausted)
                return Outcome.EXHAUSTED
            if ticket == WAIT:  # open leases elsewhere may still expire and come back
                await anyio.sleep(min(1.0, self.producer_cfg.lease_seconds / 4))
                return Outcome.WAIT
            if ticket == AGAIN:
                return Outcome.AGAIN
            if ticket == NOTHING_TO_TEACH:
                if await self.transport.redis(self.trips.nothing_to_teach):
                    r = self.trips.rows
                    log.info(
                        "every row is set aside (%d solved, %d unsolvable of %d) and a last look at "
                        "each taught nothing: nothing left to teach; producer stopping",
                        r.solved,
                        r.unsolvable,
                        r.total,
                    )
                return Outcome.NOTHING_TO_TEACH
            self.held.add(ticket)
            try:
                outcome = await self._work(ticket, granted=claim.granted)
            except SamplerError as e:  # an attempt only if the engine refused this request
                self._hand_back(ticket, error=f"sampler: {e}" if e.refused else "")
                await self.outages.engine_failed(e)
                return Outcome.ERROR
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
        if outcome is not Outcome.FAILED:
            self.outages.failures = 0
        if outcome is Outcome.PUBLISHED:
            self.outages.recovered()
        return outcome

    async def _work(self, ticket: int, *, granted: bool = False) -> Outcome:
        pos = self.order.position(ticket)
        row = copy.deepcopy(self.task.rows[pos.row])  # a rollout that edits its row changes no later epoch
        try:  # the slot is the lease's (atomically: a retried admission takes no second one)
            admission_wait = 0.0
            if not granted:
                admission_wait = await self.transport.admission_waits.wait(
                    lambda: self.transport.redis(self.admission.try_admit, ticket, self.id), self.stop.is_set
                )
                self.trips.fresh = False  # a new version may have opened the window
        except LeaseLost:
            log.warning("lease on ticket %d expired while waiting for admission", ticket)
            return Outcome.LOST
        if admission_wait is None:
            self._hand_back(ticket)
            return Outcome.STOPPED
        created, start = time.time(), time.monotonic()
        episodes = await self._rollout(row, pos, ticket)
        if episodes is None:
            return Outcome.FAILED
        sample_seconds = time.monotonic() - start
        samples, rejected = check_group(
            episodes[: self.producer_cfg.group_size],
            vocab_size=self.vocab_size,
            max_seq_len=self.cfg.trainer.max_seq_len,
            max_version=await self._newest_version(episodes),
            max_forks=self.producer_cfg.max_forks,
        )
        for err in rejected:
            self.pending.add(f"episodes_dropped_{err.reason}")
            log.warning("row %d (epoch %d): episode dropped: %s", pos.row, pos.epoch, err)
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
        values = {
            **group_values(
                group, failures=failures, sample_seconds=sample_seconds, admission_wait_seconds=admission_wait
            ),
            **episode_values([e for _, e in samples], seconds=sample_seconds, in_flight=self.in_flight),
        }
        return await self._publish(ticket, group, values)

    async def _rollout(self, row: dict, pos, ticket: int) -> list[Episode] | None:
        """The rollout's episodes, or None (counted, logged, row handed back) when it failed."""
        ctx = RolloutContext(
            task=self.task,
            group_size=self.producer_cfg.group_size,
            temperature=self.producer_cfg.temperature,
            top_p=self.producer_cfg.top_p,
            max_new_tokens=self.producer_cfg.max_new_tokens,
            seed=_seed(self.cfg.run.seed, ticket),
            sample_fn=self.transport.sample,
            max_seq_len=self.cfg.trainer.max_seq_len,
            reward_limiter=self.transport.reward_limiter,
            reward_timeout=self.cfg.reward.timeout,
        )
        where = f"row {pos.row} (epoch {pos.epoch})"
        try:
            with anyio.fail_after(self.producer_cfg.rollout_timeout or None):
                return list(await self.rollout(row, ctx))
        except Exception as e:  # user code: anything it raises drops the rollout, not the producer
            reason, why = rollout_failure(e, timeout=self.producer_cfg.rollout_timeout)
            if isinstance(first_leaf(e), PrefixMismatch):
                self.pending.add("prefix_mismatches")
        self.pending.add(f"episodes_dropped_{reason}", self.producer_cfg.group_size)
        if (wait := self.outages.shared(why, ticket, pos.row)) is not None:
            self._hand_back(ticket)  # not the row's fault: no attempt counted
            await self.outages.backoff(wait)
            return None
        # counted on the server per row (streamer/admission.py): after producer.max_row_attempts
        # failed attempts, by any producer, the next claim skips the row with this reason
        log.error("%s: rollout %s %s; row handed back", where, self.rollout_path, why)
        self._hand_back(ticket, error=f"rollout {why}")
        return None

    async def _newest_version(self, episodes: list) -> int:
        """The newest version published: read again only when an episode claims a newer one
        than last read (a rollout service's engine may follow the policy ahead of this producer)."""
        if claimed_version(episodes) > max(self._newest, self.follower.version):
            latest = await self.transport.redis(self.client.get, self.keys.version)
            self._newest = max(self._newest, parse_int(latest, self.keys.version, default=0))
        return max(self._newest, self.follower.version)

    async def _publish(self, ticket: int, group: TrajectoryGroup, values: dict[str, float]) -> Outcome:
        """The room check, the group, the row's record and its metrics event: one script
        (:mod:`producers.trips`), in one Redis call with the rare waits."""
        publish = functools.partial(self.trips.publish, ticket, group, values, stop=self.stop)
        outcome = Outcome.FULL
        if self.transport.inline and not self.trips.may_block:  # one quick call, if there is room
            outcome = await self.transport.redis(publish, wait=False)
        if outcome is Outcome.FULL:  # waiting for room (or replicas) is a worker thread's
            outcome = await self.transport.in_thread(publish)
        if outcome is Outcome.STOPPED:
            self._hand_back(ticket)  # stopping and no room: someone else publishes it later
        elif outcome is Outcome.PUBLISHED:
            self.published += 1
        return outcome

    async def _drop(self, ticket: int, *, failures: int) -> Outcome:
        # the row is done for this epoch; its slot goes back
        await self.transport.redis(self.leases.finish, ticket)
        self.pending.add("groups_dropped")
        self.pending.add("sample_failures", failures)
        await self.transport.redis(self.trips.flush_metrics)
        return Outcome.DROPPED

    def _hand_back(self, ticket: int, error: str = "") -> None:
        try:
            self.leases.hand_back(ticket, error=error)
        except redis.exceptions.RedisError as e:  # the lease will expire instead
            log.error("could not hand back ticket %d: %s", ticket, e)

    def close(self) -> None:
        self.sampler.close()


def _seed(base: int, ticket: int) -> int:
    """A sampling seed per (run seed, ticket): reruns sample the same completions."""
    return (base * 1_000_003 + ticket) % (2**31 - 1)


# ---------------------------------------------------------------- entry point


def main(cfg: RunConfig, args) -> int:
    producer_id = getattr(args, "id", None) or f"{socket.gethostname()}-{os.getpid()}"
    client = connect(
        cfg.require_redis_url(),
        socket_timeout=cfg.bus.socket_timeout,
        name=f"producer-{producer_id}",
        # every row in flight may call the server at once from a thread of its own (Transport),
        # besides the heartbeat, the weight follower and the loop itself
        max_connections=cfg.producer.concurrency + 16,
    )
    # a key of the wrong type (a string where the run keeps a stream): one line, now
    connection.retrying(
        lambda: check_types(client, Keys(cfg.run.name).types()), what="checking the run's keys"
    )
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id=producer_id, task=task, sampler=sampler)
    previous = shutdown.on_signals(producer)
    try:
        return producer.run()
    finally:
        lifecycle.restore_signals(previous)
        producer.close()
        client.close()
