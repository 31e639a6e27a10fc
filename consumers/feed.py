"""The trainer's feed: the trajectory stream in, fresh batches out, and every entry's
bookkeeping between the two — the one file where the exactly-once rules live.

A background thread reads TrajectoryGroup entries through a :class:`streamer.bus.Consumer`
(its own pending entries first, then claimed, then new ones), filters them, and collates the
next ``groups_per_step`` accepted groups into a :class:`Batch` while the current step trains,
so the step loop only waits when the producers are behind. The step loop sees three calls::

    for ready in feed.batches(until=...):   # fresh at hand-off
        train(ready.batch)
        feed.trained(ready)                 # slots back; counts toward the next checkpoint
        if checkpoint due: save(feed.covered()); feed.checkpointed(covered)

Entry bookkeeping, which the exactly-once guarantee rests on:

- an entry at or below the newest checkpoint's high-water id (the restored one, then each
  one written) is already in the persisted model: it is acknowledged, never trained again
  (pending ones when the feed starts, and any delivered later: an acknowledgement lost with
  a server, a failed-over cluster master or an AOF that had not reached disk, makes an entry
  pending again);
- a rejected entry is acknowledged in the same script as the release of its admission slot
  (:meth:`Admission.reject`); a dead-lettered one gives its slot back right after its
  dead letter is written (the consumer's ``on_gone``; a crash in between is repaired by
  :meth:`Admission.reconcile` when the feed starts);
- a batch is handed over only if every group in it is still within the staleness window
  of the current version (the version moves while a batch waits): a group gone stale is
  rejected there, and the rest of its batch is given back;
- accepted entries are trained in stream-id order (the buffer is kept sorted, and groups
  handed back dissolve the batch built ahead), so every entry not yet trained is above the
  high-water id of what was: acknowledging "at or below high-water" after a crash is exact;
- a trained entry stays pending until a checkpoint covers it (:meth:`checkpointed`), so a
  crash before that trains it again into the restored model;
- an accepted entry is *owned* (buffered, ready, or trained and waiting for a checkpoint)
  until it is acknowledged. Owned entries are touched now and then (XCLAIM JUSTID: resets
  their idle time without counting a delivery), so no other consumer's XAUTOCLAIM takes
  them, and a re-delivery of one is ignored.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from consumers.batch import Batch
from consumers.checkpoint import Covered
from consumers.filters import GroupFilter
from schemas import TrajectoryGroup
from streamer.admission import Admission
from streamer.bus import Consumer, Delivery, id_le, parse_id, trim_acked
from streamer.config import BusSection
from streamer.connection import retrying
from streamer.errors import StreamerError
from streamer.keys import TRAINER_GROUP, Keys
from streamer.values import wrong_type

log = logging.getLogger(__name__)

TRIM_SECONDS = 1.0  # the least time between two trims after rejections
# while the step loop trains, the most seconds between two reads: groups gather and are read
# (and judged, and their rejections released) several at a time instead of one by one
GATHER_SECONDS = 0.1


@dataclass
class Ready:
    """A collated batch and the stream entries it was built from."""

    batch: Batch
    groups: list[TrajectoryGroup]
    entry_ids: list[str]
    waited: float = 0.0  # seconds the step loop waited for it


class Feeder:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        name: str,
        bus: BusSection,
        admission: Admission,
        group_filter: GroupFilter,
        groups_per_step: int,
        collate: Callable[[list[TrajectoryGroup]], Batch],
        version: Callable[[], int],
        validate: Callable[[TrajectoryGroup], str | None] | None = None,
        high_water: str = "0-0",
        pin_memory: bool = False,
        block_seconds: float = 0.5,
        staleness: Callable[[TrajectoryGroup], int] | None = None,
        trim_lag: dict[str, int] | None = None,
        fence=None,
    ):
        self.consumer = Consumer(
            client,
            keys,
            keys.traj,
            TRAINER_GROUP,
            name,
            as_type=TrajectoryGroup,
            cfg=bus,
            validate=validate,
            on_gone=lambda ids: retrying(lambda: admission.release(ids), what="releasing admission slots"),
            fence=fence,  # the trainer's lease: no acknowledgement once another trainer took the run
        )
        self.admission, self.filter = admission, group_filter
        self.groups_per_step, self.collate, self.version = groups_per_step, collate, version
        self.pin_memory, self.block_seconds = pin_memory, block_seconds
        self.checkpoint_high_water = high_water  # the newest checkpoint's: entries up to it are in it
        self.high_water = high_water  # the newest entry trained
        self.touch_every = bus.claim_idle_seconds / 4
        self.staleness = staleness  # group -> trainer steps from the current weights (lineage)
        self.trim_lag = trim_lag  # groups that may hold trimming back by at most so many entries
        self._trained: list[tuple[str, str]] = []  # (entry id, group id) since the last checkpoint
        self._buffer: collections.deque[tuple[str, TrajectoryGroup]] = collections.deque()
        self._ready: Ready | None = None
        self._wanted = False  # the step loop waits in next(): read at once
        self._generation = 0  # bumped when groups are handed back: a batch being built is void
        self._owned: set[str] = set()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_touch = time.monotonic()
        self._last_trim, self._untrimmed = 0.0, False
        # finishing (the producers are done): a read begun after finish() that came back empty
        # means every entry has arrived; the groups left then make one last, smaller batch
        self._finishing, self._finish_seq, self._all_read = False, 0, False
        self._building = False  # groups taken from the buffer are being collated
        self._thread = threading.Thread(target=self._run, name="trainer-feed", daemon=True)

    # ------------------------------------------------------------ the step loop's side

    def start(self) -> Feeder:
        """Settle what a crash left (pending entries the checkpoint covers, admission slots of
        entries that are gone), then start reading."""
        if self.checkpoint_high_water != "0-0" and (
            n := self.consumer.ack_pending(self.checkpoint_high_water)
        ):
            log.info("acknowledged %d pending entries the checkpoint already covers", n)
        in_flight = self.admission.reconcile(TRAINER_GROUP)  # slots of what is gone come back
        log.info("admission: %d groups in flight", in_flight)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("feed thread did not stop within %.0fs", timeout)

    def batches(self, until: Callable[[], bool]) -> Iterator[Ready]:
        """Batches whose every group is within the staleness window at hand-off, until
        ``until()``. A group that went stale while its batch waited (the version moved on)
        is rejected, and the rest of the batch goes back to be batched again first."""
        start = time.monotonic()
        while not until():
            ready = self.next(timeout=0.25)
            if ready is None:
                continue
            entries = list(zip(ready.entry_ids, ready.groups))
            version = self.version()
            stale = {
                i for i, g in entries if self.filter.is_stale(g, version=version, staleness=self.staleness)
            }
            if stale:
                self.reject([(i, "stale") for i in stale])
                self.give_back([e for e in entries if e[0] not in stale])
                continue
            ready.waited = time.monotonic() - start
            yield ready
            start = time.monotonic()

    def next(self, timeout: float) -> Ready | None:
        """The next collated batch, or None after ``timeout``; re-raises the thread's error."""
        with self._cond:
            self._wanted = True
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: self._ready is not None or self._error is not None, timeout)
            finally:
                self._wanted = False
            if isinstance(self._error, StreamerError | redis.exceptions.ResponseError):  # the CLI's one line
                raise self._error
            if self._error is not None:
                raise RuntimeError("trajectory feed failed") from self._error
            ready, self._ready = self._ready, None
            self._cond.notify_all()
            return ready

    def trained(self, ready: Ready) -> None:
        """A step trained ``ready``: its slots come back (it no longer counts against the
        staleness window) and its entries wait, pending, for a checkpoint to cover them."""
        self._trained.extend((e, g.group_id) for e, g in zip(ready.entry_ids, ready.groups))
        self.high_water = max([self.high_water, *ready.entry_ids], key=parse_id)
        retrying(
            lambda: self.admission.release(ready.entry_ids, trained=True), what="releasing admission slots"
        )

    @property
    def uncovered(self) -> int:
        """Entries trained since the last checkpoint."""
        return len(self._trained)

    def covered(self) -> Covered:
        """What a checkpoint taken now covers."""
        return Covered(self.high_water, [e for e, _ in self._trained], [g for _, g in self._trained])

    def checkpointed(self, covered: Covered, *, give_up_after: float | None = None) -> None:
        """A checkpoint covering ``covered`` is on disk: acknowledge its entries, trim."""
        done = set(covered.entry_ids)
        self._trained = [t for t in self._trained if t[0] not in done]
        self.checkpoint_high_water = max(self.checkpoint_high_water, covered.high_water, key=parse_id)
        if not done:
            return
        retrying(
            lambda: self.consumer.ack(covered.entry_ids),
            what="acknowledging trained entries",
            give_up_after=give_up_after,
        )
        with self._cond:
            self._owned.difference_update(done)
        c = self.consumer
        retrying(
            lambda: trim_acked(c.client, c.stream, max_lag=self.trim_lag),
            what="trimming trajectories",
            give_up_after=give_up_after,
        )

    def finish(self) -> None:
        """No more groups are coming (the producers are done): once a read finds nothing
        new, batch what is left, fewer than ``groups_per_step`` groups included."""
        with self._cond:
            if not self._finishing:
                self._finishing, self._all_read = True, False
                self._finish_seq += 1
                self._cond.notify_all()

    @property
    def finishing(self) -> bool:
        return self._finishing

    def drained(self) -> bool:
        """Finishing, every entry read, and every group handed to the step loop."""
        with self._cond:
            return (
                self._finishing
                and self._all_read
                and not self._buffer
                and self._ready is None
                and not self._building
            )

    def give_back(self, entries: list[tuple[str, TrajectoryGroup]]) -> None:
        """Return accepted groups to the queue, to be batched again before anything newer."""
        with self._cond:
            if self._ready is not None:  # built ahead from newer entries: rebuild in id order
                entries = [*entries, *zip(self._ready.entry_ids, self._ready.groups)]
                self._ready = None
            self._merge(entries)
            self._generation += 1
            self._cond.notify_all()

    def dead_letter(self, ready: Ready, reason: str) -> None:
        """A step that changed no weights: its groups are dead-lettered with ``reason`` (not
        trained: `streamer dead --replay` sends them again), their slots given back."""
        ids = ready.entry_ids
        retrying(
            lambda: self.consumer.dead_letter(ids, reason), what="dead-lettering a skipped step's groups"
        )
        with self._cond:
            self._owned.difference_update(ids)

    def reject(self, rejected: list[tuple[str, str]]) -> None:
        """Acknowledge (entry id, reason) pairs, count the reasons and release their
        admission slots, atomically."""
        if not rejected:
            return
        group = self.consumer.group  # only slots these groups hold, each once
        retrying(lambda: self.admission.reject(rejected, group=group), what="rejecting groups")
        self._untrimmed = True
        with self._cond:
            self._rejected.update(reason for _, reason in rejected)
            self._owned.difference_update(entry_id for entry_id, _ in rejected)
        for entry_id, reason in rejected:
            log.debug("rejected %s: %s", entry_id, reason)

    def take_rejections(self) -> dict[str, int]:
        """Rejections by reason since the last call."""
        with self._cond:
            out, self._rejected = dict(self._rejected), collections.Counter()
            return out

    def _trim_rejected(self) -> None:
        """Rejected groups changed no weights, so no checkpoint has to cover them: trim them
        now (at most every TRIM_SECONDS), or a run where every group is rejected (all-zero
        rewards early in RL on a hard task) grows its stream without bound."""
        now = time.monotonic()
        if not self._untrimmed or now - self._last_trim < TRIM_SECONDS:
            return
        self._last_trim, self._untrimmed = now, False
        c = self.consumer
        retrying(
            lambda: trim_acked(c.client, c.stream, max_lag=self.trim_lag),
            what="trimming rejected trajectories",
        )

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._touch_owned()
                self._trim_rejected()
                taken = self._take_batch_groups()
                if taken is not None:
                    self._build(*taken)
                elif self._has_enough():
                    with self._cond:
                        self._cond.wait(0.2)
                else:
                    self._gather()
                    self._pull()
        except BaseException as e:  # surfaced to the step loop by next()
            e = wrong_type(self.consumer.client, self.consumer.keys.types(), e) or e  # named
            if isinstance(e, StreamerError | redis.exceptions.ResponseError):  # one line, no trace
                log.error("trajectory feed stopped: %s", e)
            else:
                log.exception("trajectory feed failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _take_batch_groups(self) -> tuple[int, list[tuple[str, TrajectoryGroup]]] | None:
        with self._cond:
            n = self.groups_per_step
            if self._finishing and self._all_read:  # the last groups there will be
                n = min(n, len(self._buffer))
            if self._ready is not None or not n or len(self._buffer) < n:
                return None
            self._building = True
            return self._generation, [self._buffer.popleft() for _ in range(n)]

    def _has_enough(self) -> bool:
        with self._cond:
            return len(self._buffer) >= self.groups_per_step

    def _build(self, generation: int, entries: list[tuple[str, TrajectoryGroup]]) -> None:
        groups = [g for _, g in entries]
        try:
            batch = self.collate(groups)
            if self.pin_memory:
                batch = batch.pin_memory()
        except BaseException:
            with self._cond:
                self._building = False
            raise
        with self._cond:
            self._building = False
            if generation != self._generation:  # older groups came back meanwhile
                self._merge(entries)
                return
            self._ready = Ready(batch, groups, [entry_id for entry_id, _ in entries])
            self._cond.notify_all()

    def _merge(self, entries: list[tuple[str, TrajectoryGroup]]) -> None:
        """Add entries to the buffer, keeping it in stream-id order (call with the lock held)."""
        if entries:
            merged = sorted([*self._buffer, *entries], key=lambda e: parse_id(e[0]))
            self._buffer = collections.deque(merged)

    def _gather(self) -> None:
        """Unless the step loop waits for a batch, let groups gather for GATHER_SECONDS."""
        with self._cond:
            self._cond.wait_for(lambda: self._wanted or self._stop.is_set(), GATHER_SECONDS)

    def _pull(self) -> None:
        with self._cond:
            need = max(self.groups_per_step - len(self._buffer), 1)
            seq = self._finish_seq
        deliveries = retrying(
            lambda: self.consumer.read(count=need, block=self.block_seconds), what="reading trajectories"
        )
        covered, rejected, accepted = [], [], []
        for d in deliveries:
            if id_le(d.id, self.checkpoint_high_water):
                covered.append(d.id)
            elif not self._is_owned(d.id):
                self._judge(d, rejected, accepted)
        if covered:
            log.info("acknowledging %d entries already in the checkpoint", len(covered))
            retrying(lambda: self.consumer.ack(covered), what="acknowledging trained entries")
            retrying(lambda: self.admission.release(covered), what="releasing admission slots")
        self.reject(rejected)
        with self._cond:
            self._merge(accepted)
            self._owned.update(entry_id for entry_id, _ in accepted)
            if self._finishing and seq == self._finish_seq:  # a read begun after finish()
                self._all_read = not deliveries

    def _is_owned(self, entry_id: str) -> bool:
        with self._cond:
            return entry_id in self._owned

    def _judge(self, d: Delivery[TrajectoryGroup], rejected: list, accepted: list) -> None:
        verdict = self.filter(d.event, version=self.version(), staleness=self.staleness)
        if verdict.accepted:
            accepted.append((d.id, verdict.group))
        else:
            rejected.append((d.id, verdict.reason))

    def _touch_owned(self) -> None:
        if time.monotonic() - self._last_touch < self.touch_every:
            return
        self._last_touch = time.monotonic()
        with self._cond:
            owned = list(self._owned)
        if owned:
            retrying(lambda: self.consumer.touch(owned), what="refreshing owned entries")
