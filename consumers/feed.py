"""The trainer's feed: a background thread that turns the trajectory stream into batches.

It reads TrajectoryGroup entries through a :class:`streamer.bus.Consumer` (its own pending
entries first, then claimed, then new ones), filters them, and collates the next
``groups_per_step`` accepted groups into a :class:`Batch` while the current step trains, so
the step loop only waits when the producers are behind.

Entry bookkeeping, which the exactly-once guarantee rests on:

- an entry at or below the checkpoint's high-water id is already in the persisted model:
  it is acknowledged, never trained again;
- a rejected entry is acknowledged in the same script as the release of its admission slot
  (:meth:`Admission.release`); a dead-lettered one gives its slot back right after its
  dead letter is written (the consumer's ``on_gone``; a crash in between is repaired by
  :meth:`Admission.reconcile` when the trainer starts);
- accepted entries are trained in stream-id order (the buffer is kept sorted, and groups
  handed back dissolve the batch built ahead), so every entry not yet trained is above the
  high-water id of what was: acknowledging "at or below high-water" after a crash is exact;
- an accepted entry is *owned* (buffered, ready, or trained and waiting for a checkpoint)
  until the trainer acknowledges it. Owned entries are re-claimed to this consumer now and
  then (XCLAIM JUSTID: resets their idle time without counting a delivery), so no other
  consumer's XAUTOCLAIM takes them, and a re-delivery of one is ignored.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from consumers.batch import Batch
from consumers.filters import GroupFilter
from schemas import TrajectoryGroup
from streamer.admission import Admission
from streamer.bus import Consumer, Delivery, retrying, trim_acked

log = logging.getLogger(__name__)

TRIM_SECONDS = 1.0  # the least time between two trims after rejections


@dataclass
class Ready:
    """A collated batch and the stream entries it was built from."""

    batch: Batch
    groups: list[TrajectoryGroup]
    entry_ids: list[str]
    built_at: float = field(default_factory=time.monotonic)


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_le(a: str, b: str) -> bool:
    return parse_id(a) <= parse_id(b)


class Feeder:
    def __init__(
        self,
        consumer: Consumer[TrajectoryGroup],
        *,
        admission: Admission,
        group_filter: GroupFilter,
        groups_per_step: int,
        collate: Callable[[list[TrajectoryGroup]], Batch],
        version: Callable[[], int],
        high_water: str = "0-0",
        pin_memory: bool = False,
        block_seconds: float = 0.5,
        staleness: Callable[[TrajectoryGroup], int] | None = None,
        trim_lag: dict[str, int] | None = None,
    ):
        self.consumer, self.admission, self.filter = consumer, admission, group_filter
        self.groups_per_step, self.collate, self.version = groups_per_step, collate, version
        self.high_water, self.pin_memory, self.block_seconds = high_water, pin_memory, block_seconds
        self.touch_every = consumer.cfg.claim_idle_seconds / 4
        self.staleness = staleness  # group -> trainer steps from the current weights (lineage)
        self.trim_lag = trim_lag  # groups that may hold trimming back by at most so many entries
        self._buffer: collections.deque[tuple[str, TrajectoryGroup]] = collections.deque()
        self._ready: Ready | None = None
        self._generation = 0  # bumped when groups are handed back: a batch being built is void
        self._owned: set[str] = set()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_touch = time.monotonic()
        self._last_trim, self._untrimmed = 0.0, False
        self._thread = threading.Thread(target=self._run, name="trainer-feed", daemon=True)

    # ------------------------------------------------------------ the step loop's side

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("feed thread did not stop within %.0fs", timeout)

    def next(self, timeout: float) -> Ready | None:
        """The next collated batch, or None after ``timeout``; re-raises the thread's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None or self._error is not None, timeout)
            if self._error is not None:
                raise RuntimeError("trajectory feed failed") from self._error
            ready, self._ready = self._ready, None
            self._cond.notify_all()
            return ready

    def give_back(self, entries: list[tuple[str, TrajectoryGroup]]) -> None:
        """Return accepted groups to the queue, to be batched again before anything newer."""
        with self._cond:
            if self._ready is not None:  # built ahead from newer entries: rebuild in id order
                entries = [*entries, *zip(self._ready.entry_ids, self._ready.groups)]
                self._ready = None
            self._merge(entries)
            self._generation += 1
            self._cond.notify_all()

    def reject(self, rejected: list[tuple[str, str]]) -> None:
        """Acknowledge (entry id, reason) pairs and release their admission slots, atomically."""
        if not rejected:
            return
        ids = [entry_id for entry_id, _ in rejected]
        group = self.consumer.group  # only slots these groups hold, each once
        retrying(lambda: self.admission.release(ids, ack_group=group), what="rejecting groups")
        pipe = self.consumer.client.pipeline(transaction=False)
        for reason, n in collections.Counter(reason for _, reason in rejected).items():
            pipe.hincrby(self.consumer.keys.rejected_since_step, reason, n)  # for `streamer status`
        retrying(pipe.execute, what="counting rejections")
        self._untrimmed = True
        with self._cond:
            self._rejected.update(reason for _, reason in rejected)
            self._owned.difference_update(ids)
        for entry_id, reason in rejected:
            log.debug("rejected %s: %s", entry_id, reason)

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

    def acked(self, entry_ids: list[str]) -> None:
        """The trainer acknowledged these (a checkpoint covers them): no longer owned."""
        with self._cond:
            self._owned.difference_update(entry_ids)

    def take_rejections(self) -> dict[str, int]:
        """Rejections by reason since the last call."""
        with self._cond:
            out, self._rejected = dict(self._rejected), collections.Counter()
            return out

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
                    self._pull()
        except BaseException as e:  # surfaced to the step loop by next()
            log.exception("trajectory feed failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _take_batch_groups(self) -> tuple[int, list[tuple[str, TrajectoryGroup]]] | None:
        with self._cond:
            if self._ready is not None or len(self._buffer) < self.groups_per_step:
                return None
            return self._generation, [self._buffer.popleft() for _ in range(self.groups_per_step)]

    def _has_enough(self) -> bool:
        with self._cond:
            return len(self._buffer) >= self.groups_per_step

    def _build(self, generation: int, entries: list[tuple[str, TrajectoryGroup]]) -> None:
        groups = [g for _, g in entries]
        batch = self.collate(groups)
        if self.pin_memory:
            batch = batch.pin_memory()
        with self._cond:
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

    def _pull(self) -> None:
        with self._cond:
            need = max(self.groups_per_step - len(self._buffer), 1)
        deliveries = retrying(
            lambda: self.consumer.read(count=need, block=self.block_seconds), what="reading trajectories"
        )
        covered, rejected, accepted = [], [], []
        for d in deliveries:
            if id_le(d.id, self.high_water):
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
            c = self.consumer
            retrying(
                lambda: c.client.xclaim(c.stream, c.group, c.name, 0, owned, justid=True),
                what="refreshing owned entries",
            )
