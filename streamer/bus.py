"""The Redis stream bus: connect, publish with backpressure, consume with groups.

Every event is one stream entry with a single field ``d`` holding its msgpack bytes.
Delivery is at-least-once; the exactly-once *effect* belongs to the consumers (the trainer
acknowledges only what a checkpoint covers). Entries are trimmed only once every consumer
group has acknowledged them, never by MAXLEN.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from schemas import DeadLetter, DecodeError, decode, encode
from schemas.events import Event
from streamer.config import BusSection
from streamer.errors import BackpressureTimeout, ConfigError, ServerError
from streamer.keys import TRAINER_GROUP, Keys

log = logging.getLogger(__name__)

T = TypeVar("T")
FIELD = b"d"
MIN_SERVER = (6, 2)  # XAUTOCLAIM
DEAD_MAXLEN = 100_000  # the dead-letter stream is for people; keep it bounded
TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# a cluster seed node: redis-py's cluster client discovers the rest (every key of a run is
# hash-tagged onto one slot, see streamer.keys)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


# ---------------------------------------------------------------- connecting


def redact(url: str, text: str | None = None) -> str:
    """``text`` (default: the URL itself) with the URL's password replaced by ***, safe for logs.

    Not by URL parsing alone: a password with ``#``, ``/`` or ``?`` in it makes the parser cut
    the netloc short. The raw userinfo (between ``scheme://`` and the last ``@``) becomes
    ``user:***``, and every other form of the password (as split from it, as parsed, and
    percent-decoded) is removed wherever it occurs in ``text``.
    """
    text = url if text is None else text
    scheme, sep, rest = url.partition("://")
    userinfo = rest.rpartition("@")[0] if sep else ""
    user, colon, password = userinfo.partition(":")
    if not colon or not password:
        return text
    text = text.replace(userinfo, f"{user}:***")
    forms = {password, urllib.parse.unquote(password)}
    try:
        if parsed := urllib.parse.urlsplit(url).password:
            forms |= {parsed, urllib.parse.unquote(parsed)}
    except ValueError:  # a netloc the parser rejects (e.g. a bad port): the forms above remain
        pass
    for secret in sorted(forms, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _encoding_hint(url: str) -> str:
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if any(c in userinfo.partition(":")[2] for c in "#/?@"):
        return "; a password with '#', '/', '?' or '@' must be percent-encoded (%23 %2F %3F %40)"
    return ""


def connect(
    url: str,
    *,
    socket_timeout: float = 10.0,
    name: str | None = None,
    check: bool = True,
) -> redis.Redis:
    """A client for ``url`` (redis://, rediss://, unix://, with user:password if any).

    ``socket_timeout`` must exceed the longest BLOCK the caller uses. Transient errors are
    retried a bounded number of times with jittered exponential backoff; longer outages
    are the caller's to wait out (see :func:`retrying`). With ``check``, the server is
    pinged and its version checked, raising :class:`ServerError` with one clear line.
    """
    parts = urllib.parse.urlsplit(url)
    cluster = parts.scheme in CLUSTER_SCHEMES
    if parts.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        raise ConfigError(
            redact(
                url,
                f"redis URL {url!r}: scheme must be redis://, rediss://, unix:// "
                "or redis+cluster:// (rediss+cluster://)",
            )
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(redact(url, f"redis URL {url!r} has no host{_encoding_hint(url)}"))
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(redact(url, f"redis URL {url!r} has no socket path"))
    try:
        client = (RedisCluster if cluster else redis.Redis).from_url(
            url.replace("+cluster://", "://", 1) if cluster else url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=min(5.0, socket_timeout),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
            retry_on_error=list(TRANSIENT),
            health_check_interval=30,
            client_name=name,
            protocol=2,  # RESP2 on every redis-py version and server (the shapes we parse)
        )
    except ValueError as e:
        why = _encoding_hint(url) or f": {e}"  # the parser's message may quote a piece of the password
        raise ConfigError(redact(url, f"redis URL {url!r} cannot be used{why}")) from None
    if check:
        check_server(client, url)
    return client


def check_server(client: redis.Redis, url: str) -> tuple[int, ...]:
    try:
        info = client.info("server")
    except redis.exceptions.AuthenticationError as e:
        raise ServerError(redact(url, f"{url}: authentication failed ({e})")) from None
    except redis.exceptions.ResponseError as e:
        raise ServerError(redact(url, f"{url}: {e}")) from None
    except TRANSIENT as e:
        raise ServerError(redact(url, f"cannot reach the server at {url}: {e}")) from None
    raw = str(info.get("valkey_version") or info.get("redis_version") or "0")
    version = tuple(int(p) for p in raw.split(".")[:3] if p.isdigit())
    # valkey reports redis_version 7.2.4 for compatibility; either way it must be >= 6.2
    if version[:2] < MIN_SERVER:
        raise ServerError(
            redact(url, f"server at {url} is version {raw}; streamer needs >= 6.2 (XAUTOCLAIM)")
        )
    return version


def retrying(fn: Callable[[], T], *, what: str, give_up_after: float | None = None) -> T:
    """Call ``fn`` until the server answers, backing off to 5 s, logging each failure.

    For outages longer than the client's own few retries (a server restart).
    """
    delay, start = 0.1, time.monotonic()
    while True:
        try:
            return fn()
        except TRANSIENT as e:
            if give_up_after is not None and time.monotonic() - start > give_up_after:
                raise ServerError(f"{what}: server unavailable for {give_up_after:.0f}s: {e}") from e
            log.warning("%s: server unavailable (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


# ---------------------------------------------------------------- publishing


def unacked(client: redis.Redis, stream: str, group: str = TRAINER_GROUP) -> int:
    """Entries of ``stream`` that ``group`` has not acknowledged (pending + never read)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.exceptions.ResponseError:  # no such stream yet
        return 0
    for g in groups:
        if _s(g["name"]) == group:
            lag = g.get("lag")
            if lag is None:  # unknown after some deletions: count what follows last-delivered
                lag = len(client.xrange(stream, min=f"({_s(g['last-delivered-id'])}", count=100_000))
            return int(g["pending"]) + int(lag)
    return int(client.xlen(stream))  # the group does not exist yet: nobody read anything


class Publisher:
    """XADD events; wait (bounded, logged) while the trajectory stream is too far ahead."""

    def __init__(self, client: redis.Redis, keys: Keys, cfg: BusSection):
        self.client, self.keys, self.cfg = client, keys, cfg
        self.waited_seconds = 0.0  # total time spent in backpressure

    def publish(self, stream: str, event: Event) -> str:
        return _s(self.client.xadd(stream, {FIELD: encode(event)}))

    def publish_many(self, stream: str, events: Iterable[Event]) -> list[str]:
        """One round trip for several events (pipelined, not transactional)."""
        pipe = self.client.pipeline(transaction=False)
        for e in events:
            pipe.xadd(stream, {FIELD: encode(e)})
        return [_s(i) for i in pipe.execute()]

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
    ):
        self.client, self.keys, self.stream, self.group, self.name = client, keys, stream, group, name
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
            return self._read(count or self.cfg.read_count, block)
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
        return int(self.client.xack(self.stream, self.group, *ids)) if ids else 0

    def _read_history(self, count: int) -> list:
        resp = self.client.xreadgroup(self.group, self.name, {self.stream: self._pending_cursor}, count=count)
        entries = resp[0][1] if resp else []
        if entries:
            self._pending_cursor = _s(entries[-1][0])
        return entries

    def _claim(self, count: int) -> list:
        idle_ms = int(self.cfg.claim_idle_seconds * 1000)
        reply = self.client.xautoclaim(self.stream, self.group, self.name, idle_ms, "0-0", count=count)
        # Redis 7.0+ replies [cursor, entries, deleted ids]; 6.2 has no third item
        entries, deleted = reply[1], (reply[2] if len(reply) > 2 else [])
        if deleted:  # trimmed while pending: nothing to deliver; the claim already removed them
            log.warning("%s: %d claimed entries no longer exist", self.stream, len(deleted))
            self._gone([_s(d) for d in deleted])
        if entries:
            log.info("%s: claimed %d idle entries from other consumers", self.stream, len(entries))
        return entries

    def _accept(self, entries: list, *, history: bool) -> list[Delivery[T]]:
        counts = self._delivery_counts(entries) if history else {}
        out, dead = [], []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
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
        lo, hi = _s(entries[0][0]), _s(entries[-1][0])
        rows = self.client.xpending_range(
            self.stream, self.group, min=lo, max=hi, count=len(entries) * 2, consumername=self.name
        )
        return {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}

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
            pipe.xadd(self.keys.dead, {FIELD: encode(letter)}, maxlen=DEAD_MAXLEN, approximate=True)
            pipe.xack(self.stream, self.group, entry_id)
        pipe.execute()
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
    except redis.exceptions.ResponseError:
        return 0
    if not groups:
        return 0
    max_lag = max_lag or {}
    cuts: dict[str, tuple[int, int]] = {}
    for g in groups:
        name = _s(g["name"])
        # the pending list may empty between XINFO and XPENDING (a consumer acknowledging):
        # then nothing up to the last-delivered id XINFO saw is pending any more
        oldest = client.xpending(stream, name)["min"] if int(g["pending"]) > 0 else None
        if oldest is not None:
            cuts[name] = _parse_id(_s(oldest))
        else:
            ms, seq = _parse_id(_s(g["last-delivered-id"]))
            cuts[name] = (ms, seq + 1)
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


def _lag_bound(client, stream: str, group: str, cut: tuple[int, int], bound: tuple[int, int], limit: int):
    """``cut``, or the id ``limit`` entries before ``bound`` if ``cut`` is further behind."""
    rows = client.xrevrange(stream, max=f"({bound[0]}-{bound[1]}", min=f"{cut[0]}-{cut[1]}", count=limit + 1)
    if len(rows) <= limit:
        return cut
    log.warning("%s: group %s is more than %d entries behind; trimming past it", stream, group, limit)
    return _parse_id(_s(rows[limit - 1][0]))


# ---------------------------------------------------------------- plain readers


class Tail(Generic[T]):
    """Follows a stream with plain XREAD (no group): the policy stream's readers.

    Entries that do not decode are logged once and skipped (a plain reader owns nothing
    to acknowledge; the writer's bug is for the dead-letter stream of a group consumer).
    """

    def __init__(self, client: redis.Redis, stream: str, *, as_type: type[T], last_id: str = "0"):
        self.client, self.stream, self.as_type, self.last_id = client, stream, as_type, last_id

    def latest(self) -> T | None:
        """The newest event (or None), also moving the cursor to it."""
        rows = self.client.xrevrange(self.stream, count=1)
        if not rows:
            return None
        entry_id, fields = rows[0]
        self.last_id = _s(entry_id)
        return self._decode(self.last_id, fields)

    def poll(self, block: float = 0.0, count: int = 100) -> list[T]:
        resp = self.client.xread(
            {self.stream: self.last_id}, count=count, block=int(block * 1000) if block > 0 else None
        )
        out = []
        for entry_id, fields in resp[0][1] if resp else []:
            self.last_id = _s(entry_id)
            event = self._decode(self.last_id, fields)
            if event is not None:
                out.append(event)
        return out

    def _decode(self, entry_id: str, fields: dict) -> T | None:
        try:
            return decode(fields.get(FIELD, b""), self.as_type)
        except DecodeError as e:
            log.error("%s %s: skipping undecodable entry: %s", self.stream, entry_id, e.reason)
            return None


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


encode_raw = msgspec.msgpack.Encoder().encode


def _flatten(fields: dict) -> bytes:
    """An entry's fields as msgpack, for a dead letter of an entry without a payload."""
    return encode_raw({_s(k): bytes(v) for k, v in fields.items()})


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
