"""The Redis stream bus: the wire entry, publish with backpressure, consume with groups.

Every event is one stream entry with a single field ``d`` holding its msgpack bytes
(:func:`entry`, :func:`entry_event`); connecting and riding out outages is
:mod:`streamer.connection`. Delivery is at-least-once; the exactly-once *effect* belongs
to the consumers (the trainer acknowledges only what a checkpoint covers). Entries are
trimmed only once every consumer group has acknowledged them, never by MAXLEN. Readers
without a group (the policy stream's) are :class:`streamer.tail.Tail`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import redis

from schemas import DeadLetter, DecodeError, decode, encode
from schemas.events import Event
from streamer.config import BusSection
from streamer.connection import TRANSIENT, replicated
from streamer.errors import BackpressureTimeout
from streamer.keys import TRAINER_GROUP, Keys

log = logging.getLogger(__name__)

T = TypeVar("T")
FIELD = b"d"
DEAD_MAXLEN = 100_000  # the dead-letter stream is for people; keep it bounded


# ---------------------------------------------------------------- entries and ids


def entry(event: Event) -> dict[bytes, bytes]:
    """The stream entry of an event: one field ``d`` holding its msgpack bytes."""
    return {FIELD: encode(event)}


def entry_event(fields: dict, as_type: type[T]) -> T:
    """The event an entry's fields hold; :class:`DecodeError` if they hold none."""
    return decode(fields.get(FIELD, b""), as_type)


def scan(client: redis.Redis, stream: str, as_type: type[T], *, after: str = "-", chunk: int = 1000):
    """(entry id, event) for every entry after ``after`` (exclusive; "-": from the start),
    oldest first, read in chunks; an entry that does not decode comes with None."""
    start = after if after == "-" else f"({after}"
    while rows := client.xrange(stream, min=start, count=chunk):
        for raw_id, fields in rows:
            try:
                yield as_str(raw_id), entry_event(fields, as_type)
            except DecodeError:
                yield as_str(raw_id), None
        start = f"({as_str(rows[-1][0])}"


def as_str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_id(entry_id: str) -> tuple[int, int]:
    """A stream id as (milliseconds, sequence), to compare ids in order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_le(a: str, b: str) -> bool:
    return parse_id(a) <= parse_id(b)


# ---------------------------------------------------------------- publishing


def unacked(client: redis.Redis, stream: str, group: str = TRAINER_GROUP) -> int:
    """Entries of ``stream`` that ``group`` has not acknowledged (pending + never read)."""
    try:
        groups = client.xinfo_groups(stream)
    except TRANSIENT:  # a cluster that is down is not "no stream": no room known, the caller waits
        raise
    except redis.exceptions.ResponseError:  # no such stream yet
        return 0
    for g in groups:
        if as_str(g["name"]) == group:
            return int(g["pending"]) + group_lag(client, stream, g)
    return int(client.xlen(stream))  # the group does not exist yet: nobody read anything


def group_lag(client: redis.Redis, stream: str, g: dict) -> int:
    """Entries of ``stream`` after group ``g``'s last-delivered id (``g``: an XINFO GROUPS
    row); counted when the server cannot tell (after some deletions)."""
    if (lag := g.get("lag")) is None:
        lag = len(client.xrange(stream, min=f"({as_str(g['last-delivered-id'])}", count=1_000_000))
    return int(lag)


class Publisher:
    """XADD events; wait (bounded, logged) while the trajectory stream is too far ahead."""

    def __init__(self, client: redis.Redis, keys: Keys, cfg: BusSection):
        self.client, self.keys, self.cfg = client, keys, cfg
        self.waited_seconds = 0.0  # total time spent in backpressure

    def publish(self, stream: str, event: Event) -> str:
        return as_str(self.client.xadd(stream, entry(event)))

    def publish_many(self, stream: str, events: Iterable[Event]) -> list[str]:
        """One round trip for several events (pipelined, not transactional)."""
        pipe = self.client.pipeline(transaction=False)
        for e in events:
            pipe.xadd(stream, entry(e))
        return [as_str(i) for i in pipe.execute()]

    def wait_for_room(self, stop: Callable[[], bool] = lambda: False) -> float:
        """Block while the trainer group has more than ``max_unacked`` entries outstanding."""
        limit, start, logged = self.cfg.max_unacked, time.monotonic(), 0.0
        delay = 0.05
        while (n := unacked(self.client, self.keys.traj)) >= limit and not stop():
            waited = time.monotonic() - start
            if waited > self.cfg.backpressure_timeout:
                raise BackpressureTimeout(
                    f"{self.keys.traj} held {n} unacknowledged entries for {waited:.0f}s "
                    f"(max_unacked={limit}); is the trainer running?"
                )
            if waited - logged >= 10.0 or logged == 0.0:
                log.info("backpressure: %d unacked entries >= %d, waiting", n, limit)
                logged = waited or 1e-9
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)  # resume within a quarter second of room
        waited = time.monotonic() - start
        self.waited_seconds += waited
        return waited


# ---------------------------------------------------------------- consuming


@dataclass(frozen=True, slots=True)
class Delivery(Generic[T]):
    id: str
    event: T
    deliveries: int  # how often the server has delivered this entry (1 = first time)
    size: int  # payload bytes


class Consumer(Generic[T]):
    """One consumer of a consumer group: own pending entries first, then claims, then new.

    Entries that fail to decode (or that ``validate`` finds unusable), or that were delivered
    more than ``max_deliveries`` times, are dead-lettered and acknowledged in one transaction;
    ``read`` never raises for them.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        stream: str,
        group: str,
        name: str,
        *,
        as_type: type[T],
        cfg: BusSection,
        start_id: str = "0",
        validate: Callable[[T], str | None] | None = None,
        on_gone: Callable[[list[str]], None] | None = None,
        fence=None,
    ):
        self.client, self.keys, self.stream, self.group, self.name = client, keys, stream, group, name
        # the trainer's lease (streamer.trainer_lease): every ack checks its fencing token
        self.fence = fence
        self.as_type, self.cfg = as_type, cfg
        self.validate = validate  # event -> reason it is unusable (dead-lettered), or None
        # entry ids: entries this consumer will never deliver (dead-lettered,
        # deleted while pending), so their owner can let go of them (the trainer: admission slots)
        self.on_gone = on_gone
        self.dead_lettered = 0
        self._pending_cursor: str | None = "0"  # None once our own pending list is drained
        self._next_claim = 0.0
        self.ensure_group(start_id)

    def ensure_group(self, start_id: str = "0") -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, count: int | None = None, block: float | None = None) -> list[Delivery[T]]:
        try:
            out = self._read(count or self.cfg.read_count, block)
            if out:  # with bus.min_replicas: act only on entries (and their delivery) a replica holds
                replicated(self.client, self.keys.replicated, self.cfg)
            return out
        except TRANSIENT:
            # the server may have delivered entries whose reply was lost (a timeout, a dropped
            # connection): they sit in our pending list unseen, so read that again first
            self._pending_cursor = "0"
            raise

    def _read(self, count: int, block: float | None) -> list[Delivery[T]]:
        if self._pending_cursor is not None:
            entries = self._read_history(count)
            if entries:
                return self._accept(entries, history=True)
            self._pending_cursor = None
        if time.monotonic() >= self._next_claim:
            entries = self._claim(count)
            if entries:
                return self._accept(entries, history=True)
            self._next_claim = time.monotonic() + self.cfg.claim_idle_seconds / 4
        block_s = self.cfg.block_seconds if block is None else block
        resp = self.client.xreadgroup(
            self.group,
            self.name,
            {self.stream: ">"},
            count=count,
            block=int(block_s * 1000) if block_s > 0 else None,
        )
        entries = resp[0][1] if resp else []
        return self._accept(entries, history=False)

    def ack(self, ids: Iterable[str]) -> int:
        ids = list(ids)
        if ids and self.fence is not None:
            return self.fence.ack(self.stream, self.group, ids)
        return int(self.client.xack(self.stream, self.group, *ids)) if ids else 0

    def ack_pending(self, up_to: str) -> int:
        """Acknowledge this consumer's pending entries with ids <= ``up_to``; how many."""
        rows = self.client.xpending_range(
            self.stream, self.group, min="-", max=up_to, count=1_000_000, consumername=self.name
        )
        return self.ack(as_str(r["message_id"]) for r in rows)

    def touch(self, ids: list[str]) -> None:
        """Reset the idle time of entries this consumer holds (XCLAIM JUSTID: no delivery is
        counted), so no other consumer's claim takes them while they are being worked on."""
        if ids:
            self.client.xclaim(self.stream, self.group, self.name, 0, ids, justid=True)

    def _read_history(self, count: int) -> list:
        resp = self.client.xreadgroup(self.group, self.name, {self.stream: self._pending_cursor}, count=count)
        entries = resp[0][1] if resp else []
        if entries:
            self._pending_cursor = as_str(entries[-1][0])
        return entries

    def _claim(self, count: int) -> list:
        idle_ms = int(self.cfg.claim_idle_seconds * 1000)
        reply = self.client.xautoclaim(self.stream, self.group, self.name, idle_ms, "0-0", count=count)
        # Redis 7.0+ replies [cursor, entries, deleted ids]; 6.2 has no third item
        entries, deleted = reply[1], (reply[2] if len(reply) > 2 else [])
        if deleted:  # trimmed while pending: nothing to deliver; the claim already removed them
            log.warning("%s: %d claimed entries no longer exist", self.stream, len(deleted))
            self._gone([as_str(d) for d in deleted])
        if entries:
            log.info("%s: claimed %d idle entries from other consumers", self.stream, len(entries))
        return entries

    def _accept(self, entries: list, *, history: bool) -> list[Delivery[T]]:
        counts = self._delivery_counts(entries) if history else {}
        out, dead = [], []
        for raw_id, fields in entries:
            entry_id = as_str(raw_id)
            if not fields:  # deleted while pending (history read): nothing to deliver
                self.ack([entry_id])
                self._gone([entry_id])
                continue
            payload = fields.get(FIELD)
            n = counts.get(entry_id, 1)
            if payload is None:
                dead.append((entry_id, _flatten(fields), "entry has no `d` field"))
            elif n > self.cfg.max_deliveries:
                dead.append((entry_id, payload, f"delivered {n} times (max {self.cfg.max_deliveries})"))
            else:
                try:
                    event = decode(payload, self.as_type)
                except DecodeError as e:
                    dead.append((entry_id, payload, e.reason))
                else:
                    if self.validate is not None and (reason := self.validate(event)):
                        dead.append((entry_id, payload, reason))
                    else:
                        out.append(Delivery(entry_id, event, n, len(payload)))
        if dead:
            self._dead_letter(dead)
        return out

    def _gone(self, entry_ids: list[str]) -> None:
        if self.on_gone is not None and entry_ids:
            self.on_gone(entry_ids)

    def _delivery_counts(self, entries: list) -> dict[str, int]:
        lo, hi = as_str(entries[0][0]), as_str(entries[-1][0])
        rows = self.client.xpending_range(
            self.stream, self.group, min=lo, max=hi, count=len(entries) * 2, consumername=self.name
        )
        return {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def dead_letter(self, ids: list[str], reason: str) -> None:
        """Dead-letter delivered entries with ``reason`` (their payloads as the stream holds
        them), acknowledged in the same transaction."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.stream, entry_id, entry_id)
        found = [rows[0][1] if rows else {} for rows in pipe.execute()]
        self._dead_letter([(i, f.get(FIELD, b""), reason) for i, f in zip(ids, found, strict=True)])

    def _dead_letter(self, dead: list[tuple[str, bytes, str]]) -> None:
        pipe = self.client.pipeline(transaction=True)
        for entry_id, payload, reason in dead:
            log.warning("%s %s -> dead letter: %s", self.stream, entry_id, reason)
            letter = DeadLetter(
                stream=self.stream,
                entry_id=entry_id,
                raw=bytes(payload),
                reason=reason,
                consumer=f"{self.group}/{self.name}",
            )
            pipe.xadd(self.keys.dead, entry(letter), maxlen=DEAD_MAXLEN, approximate=True)
            if self.fence is None:
                pipe.xack(self.stream, self.group, entry_id)
        pipe.execute()
        if self.fence is not None:  # fenced: a letter may be written twice, never acked by a stale owner
            self.ack([entry_id for entry_id, _, _ in dead])
        self._gone([entry_id for entry_id, _, _ in dead])
        self.dead_lettered += len(dead)


def trim_acked(client: redis.Redis, stream: str, *, max_lag: dict[str, int] | None = None) -> int:
    """Delete entries every consumer group has acknowledged; returns how many went.

    The cut is the oldest entry any group still needs: its smallest pending id, or the
    entry after its last-delivered id. A stream without groups is never trimmed. A group
    named in ``max_lag`` (the rollout archiver) holds the cut back by at most that many
    entries behind the other groups' cut; past that it loses what it has not read.
    """
    try:
        groups = client.xinfo_groups(stream)
    except TRANSIENT:
        raise
    except redis.exceptions.ResponseError:
        return 0
    if not groups:
        return 0
    max_lag = max_lag or {}
    cuts = {as_str(g["name"]): _needed_from(client, stream, g) for g in groups}
    strict = [c for n, c in cuts.items() if n not in max_lag]
    if strict:
        bound = min(strict)
        for name, limit in max_lag.items():
            if name in cuts and cuts[name] < bound:
                cuts[name] = _lag_bound(client, stream, name, cuts[name], bound, limit)
    ms, seq = min(cuts.values())
    if (ms, seq) <= (0, 1):
        return 0
    return int(client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))


def hold_back(
    client: redis.Redis, stream: str, cut: tuple[int, int], group: str, limit: int
) -> tuple[int, int]:
    """``cut`` (a trim's MINID), moved back to the oldest entry ``group`` still needs, by at
    most ``limit`` entries; ``cut`` itself when the stream has no such group."""
    try:
        groups = client.xinfo_groups(stream)
    except TRANSIENT:
        raise
    except redis.exceptions.ResponseError:
        return cut
    for g in groups:
        if as_str(g["name"]) == group:
            needed = _needed_from(client, stream, g)
            return cut if needed >= cut else _lag_bound(client, stream, group, needed, cut, limit)
    return cut


def _needed_from(client: redis.Redis, stream: str, g: dict) -> tuple[int, int]:
    """The oldest entry of ``stream`` that group ``g`` (an XINFO GROUPS row) still needs: its
    oldest pending entry, or the one after its last-delivered id."""
    # the pending list may empty between XINFO and XPENDING (a consumer acknowledging):
    # then nothing up to the last-delivered id XINFO saw is pending any more
    oldest = client.xpending(stream, as_str(g["name"]))["min"] if int(g["pending"]) > 0 else None
    if oldest is not None:
        return parse_id(as_str(oldest))
    ms, seq = parse_id(as_str(g["last-delivered-id"]))
    return ms, seq + 1


def _lag_bound(client, stream: str, group: str, cut: tuple[int, int], bound: tuple[int, int], limit: int):
    """``cut``, or the id ``limit`` entries before ``bound`` if ``cut`` is further behind."""
    rows = client.xrevrange(stream, max=f"({bound[0]}-{bound[1]}", min=f"{cut[0]}-{cut[1]}", count=limit + 1)
    if len(rows) <= limit:
        return cut
    log.warning("%s: group %s is more than %d entries behind; trimming past it", stream, group, limit)
    return parse_id(as_str(rows[limit - 1][0]))


def _flatten(fields: dict) -> bytes:
    """An entry's fields as msgpack, for a dead letter of an entry without a payload."""
    return msgspec.msgpack.encode({as_str(k): bytes(v) for k, v in fields.items()})
