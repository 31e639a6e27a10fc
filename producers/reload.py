"""Which policy version sampled each token of a shared inference server, under load.

Every process that samples from one server (producers, the evaluator) keeps one
:class:`ServerVersions` for it. It owns the decision of which version a token carries:

- **A request is a flight.** Before a request goes out it registers in the server's
  readers set (``…:engine_readers:<server>``, a lease per request) and reads the version
  the server serves (``…:served:<server>``), atomically; while an update is under way
  (``…:engine_update:<server>``) nothing registers: new requests wait, so no request can
  reach the server unseen during one.
- **One update per version and server.** One process wins the lock
  (``…:reload_lock:<server>``), says which update it runs, and then, by
  ``producer.inflight_updates``:

  - ``drain``: waits until no flight is left (each finishes under the version it started
    with), pauses the engine, loads, resets the prefix cache, resumes. No request spans two
    versions; the stall is the longest request in flight.
  - ``abort``: every flight stops reading its stream (the engine aborts a request whose
    client left); the tokens it has were all sampled before the load. Once none is left it
    pauses, loads, resets, resumes, and each flight goes on from prompt + tokens so far
    under the new version (AReaL's partial rollouts).
  - ``keep``: pauses the engine with requests kept in place, loads, resets the prefix cache
    and makes running requests recompute their KV under the new weights, and resumes:
    requests go on under the new version (PipelineRL's in-flight update, without KV that
    old weights wrote). Once loaded, still paused, each flight whose stream has been quiet
    for :data:`SETTLE` seconds (the old version's last tokens have arrived: nothing samples
    while paused) records where its old-version tokens end and acknowledges
    (``…:engine_acks:<server>``); the engine resumes once every flight has.

  The version the server now serves is recorded before generation resumes, so a request
  that registers after the update is stamped with the new version.
- **A token's version** is the version of the flight that received it, switched at the
  recorded boundary in ``keep``: a completion carries each run of tokens with its version
  (:class:`~streamer.rollout.contract.Completion` ``switches``), and a sample's oldest
  token is its version for the staleness window.

A process that died mid-request frees its flights when their leases run out
(:data:`FLIGHT_LEASE`, renewed while the process lives); an update whose process died ends
when its record expires. Releases and the end of an update are retried through a server
failover. A request that waits longer than that for
an update is an engine outage (``status`` names it), never a silent stall. LoRA adapter
versions need none of this: each request names its adapter.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from streamer import problems
from streamer.connection import retrying
from streamer.errors import SamplerError, ServerError
from streamer.keys import Keys

log = logging.getLogger(__name__)

MODES = ("drain", "keep", "abort")
POLL = 0.02  # seconds between looks at the update record (waiting flights, the watcher)
SETTLE = 0.2  # seconds a paused stream must stay quiet before its old tokens are counted
REPORT_AFTER = 30.0  # seconds a request waits for an update before `status` says so
FLIGHT_LEASE = 30.0  # seconds a request's registration lives unless renewed (its process died)
RENEW_EVERY = 5.0  # seconds between renewals of a process's registrations
CLEANUP_WAIT = 60.0  # seconds a release or an update's end is retried through a server outage

# KEYS: served ; ARGV: version -> the version now recorded (never lowered)
_RAISE = """
local now = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > now then redis.call('SET', KEYS[1], ARGV[1]); return tonumber(ARGV[1]) end
return now
"""

# KEYS: lock ; ARGV: token -> 1 if released by its holder
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: readers, update, served ; ARGV: flight id, lease ms, the version this process last
# knew served -> the served version, or -1 while an update is under way (nothing registered).
# No record (a server that lost its data): the caller's, written back for the others
_BOARD = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local served = redis.call('GET', KEYS[3])
if served then return tonumber(served) end
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[3], ARGV[3]) end
return tonumber(ARGV[3])
"""

# KEYS: readers ; ARGV: lease ms, flight ids -> their leases renewed (those still registered)
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
return #ARGV - 1
"""

# KEYS: readers, acks -> flights alive, alive and not acknowledged, alive and not streamed ("w:")
_LEFT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local alive = redis.call('ZRANGE', KEYS[1], 0, -1)
local unacked, whole = 0, 0
for _, id in ipairs(alive) do
  if redis.call('SISMEMBER', KEYS[2], id) == 0 then unacked = unacked + 1 end
  if string.sub(id, 1, 2) == 'w:' then whole = whole + 1 end
end
return {#alive, unacked, whole}
"""


def server_id(url: str) -> str:
    """A short stable name for an inference server (its normalised URL, digested)."""
    return hashlib.sha256(url.rstrip("/").lower().encode()).hexdigest()[:16]


class Flight:
    """One request's view of the server's version. The reader calls :meth:`stamp` for each
    chunk it receives (under the flight's lock) and stops reading once ``cut`` is set."""

    def __init__(self, fid: str, version: int):
        self.id, self.version = fid, version
        self.cut = False  # abort: an update wants in; keep what came, stop reading
        self.acked = -1  # keep: the update target whose boundary this flight recorded
        self.last = time.monotonic()  # when the last chunk came
        self.chunks = 0  # chunks received
        self.lock = threading.Lock()

    def stamp(self) -> int:
        """The version of the tokens arriving now (the caller holds ``lock``)."""
        self.last = time.monotonic()
        self.chunks += 1
        return self.version


class ServerVersions:
    """The versions a shared inference server serves, as every process sampling it sees them."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        url: str,
        *,
        lock_seconds: float,
        flight_seconds: float = FLIGHT_LEASE,
        mode: str = "drain",
        poll: float = POLL,
        who: str = "",
    ):
        if mode not in MODES:
            raise ValueError(f"inflight_updates {mode!r}: one of {', '.join(MODES)}")
        sid = server_id(url)
        self.client, self.keys, self.url, self.mode = client, keys, url, mode
        # in status's problems while its requests wait long for an update (the role's name + what)
        self.who = f"{who} (engine update)" if who else ""
        self.served_key, self.lock_key = keys.served(sid), keys.reload_lock(sid)
        self.readers_key, self.update_key = keys.engine_readers(sid), keys.engine_update(sid)
        self.acks_key = keys.engine_acks(sid)
        self.lock_seconds, self.poll = lock_seconds, poll
        self.flight_seconds = flight_seconds  # a flight's lease, renewed while it lives
        self._raise = client.register_script(_RAISE)
        self._release = client.register_script(_RELEASE)
        self._board = client.register_script(_BOARD)
        self._left = client.register_script(_LEFT)
        self._renew = client.register_script(_RENEW)
        self.reloads = 0  # reloads this process performed (the rest were someone else's)
        self.known = 0  # the newest version this process knows the server served (0: start-up)
        self.last_stall = 0.0  # seconds the last update held generation
        # this process's lock token: a SET whose reply was lost (a server stalled, then
        # resumed) may still have taken the lock, and must not make us wait for ourselves
        self.token = uuid.uuid4().hex
        self._flights: dict[str, Flight] = {}
        self._mu = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------ the record

    def served(self) -> int:
        raw = self.client.get(self.served_key)
        try:
            return -1 if raw is None else int(raw)
        except ValueError:
            raise SamplerError(f"{self.served_key} holds {raw!r}, not a version number") from None

    def update_under_way(self) -> tuple[str, str, int] | None:
        """(mode, state, target version) of the update under way, or None."""
        raw = self.client.get(self.update_key)
        if raw is None:
            return None
        mode, state, target = raw.decode().split(":")
        return mode, state, int(target)

    # ------------------------------------------------------------ flights

    @contextmanager
    def flight(self, *, streamed: bool = True) -> Iterator[Flight]:
        """Register one request for its duration; waits while an update is under way. A
        request not ``streamed`` cannot tell where an update fell in it: a ``keep`` update
        waits for it to end before pausing (a process in ``drain`` sharing the server with
        one in ``keep``)."""
        fid = f"{'s' if streamed else 'w'}:{self.token}:{uuid.uuid4().hex[:12]}"
        start = time.monotonic()
        reported = False
        board = [fid, self._lease_ms(), self.known]
        while (version := int(self._board(keys=self._board_keys(), args=board))) < 0:
            waited = time.monotonic() - start
            if waited > REPORT_AFTER and not reported and self.who:
                what = f"{self.url}: requests held {waited:.0f}s by an update ({self.update_under_way()})"
                problems.report(self.client, self.keys, self.who, what)
                reported = True
            if waited > 2 * self.lock_seconds:
                raise SamplerError(
                    f"{self.url}: an update ({self.update_under_way()}) has held generation for over "
                    f"{2 * self.lock_seconds:.0f}s"
                )
            time.sleep(self.poll)
        if reported:
            problems.clear(self.client, self.keys, self.who)
        self.known = max(self.known, version)
        flight = Flight(fid, version)
        with self._mu:
            self._flights[fid] = flight
            self._start_watcher()
            self._mu.notify_all()
        try:
            yield flight
        finally:
            with self._mu:
                self._flights.pop(fid, None)
            try:  # through a failover too: an update waits for it until its lease runs out
                retrying(
                    lambda: self.client.zrem(self.readers_key, fid),
                    what=f"releasing a request on {self.url}",
                    give_up_after=CLEANUP_WAIT,
                )
            except (redis.exceptions.RedisError, ServerError) as e:  # its lease runs out instead
                log.warning("could not release request %s on %s: %s", fid, self.url, e)

    def _board_keys(self) -> list[str]:
        return [self.readers_key, self.update_key, self.served_key]

    def _lease_ms(self) -> int:
        return int(self.flight_seconds * 1000)

    def _start_watcher(self) -> None:
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="engine-updates", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """While flights are out: renew their leases, see an update under way and do this
        process's part of it."""
        renewed = time.monotonic()
        while not self._closed:
            with self._mu:
                while not self._flights and not self._closed:
                    self._mu.wait(1.0)
                flights = list(self._flights.values())
            try:
                if time.monotonic() - renewed > RENEW_EVERY and flights:
                    self._renew(keys=[self.readers_key], args=[self._lease_ms(), *(f.id for f in flights)])
                    renewed = time.monotonic()
                if (update := self.update_under_way()) is not None:
                    self._take_part(update, flights)
            except (redis.exceptions.RedisError, ValueError) as e:  # the next look tries again
                log.warning("cannot take part in the update of %s: %s", self.url, e)
            time.sleep(self.poll)

    def _take_part(self, update: tuple[str, str, int], flights: list[Flight]) -> None:
        mode, state, target = update
        if mode == "abort":
            for f in flights:
                f.cut = True
        elif mode == "keep" and state == "loaded":
            now = time.monotonic()
            for f in flights:
                if f.acked == target or f.version >= target:
                    continue
                with f.lock:  # no chunk is being stamped while the boundary moves
                    if now - f.last < SETTLE:
                        continue  # old tokens may still be on their way
                    f.version, f.acked = target, target
                self.client.sadd(self.acks_key, f.id)

    def close(self) -> None:
        with self._mu:
            self._closed = True
            self._mu.notify_all()

    # ------------------------------------------------------------ updates

    def ensure(self, version: int, reload: Callable[[], None], *, engine=None) -> int:
        """Make the server serve ``version`` or newer (updating it ourselves if we win the
        lock); returns the version it now serves. ``engine`` (pause, resume, reset) runs the
        in-flight protocol around ``reload``; without one, ``reload`` runs alone (a LoRA
        adapter, which requests name). Raises what ``reload`` raises."""
        deadline = time.monotonic() + 2 * self.lock_seconds
        while (served := self.served()) < version:
            if self._take_lock():
                try:
                    if (served := self.served()) < version:  # not done while we took the lock
                        if engine is None:
                            reload()
                        else:
                            self._update(version, reload, engine)
                        self.reloads += 1
                        served = int(self._raise(keys=[self.served_key], args=[version]))
                        log.info("reloaded %s to version %d for every process sharing it", self.url, version)
                    self.known = max(self.known, served)
                    return served
                finally:
                    self._release(keys=[self.lock_key], args=[self.token])
            if time.monotonic() > deadline:
                raise SamplerError(
                    f"{self.url}: no producer confirmed version {version} within {2 * self.lock_seconds:.0f}s"
                )
            time.sleep(self.poll)  # another process is updating: wait for its record
        self.known = max(self.known, served)
        return served

    def _update(self, version: int, reload: Callable[[], None], engine) -> None:
        """The in-flight protocol of ``self.mode`` around ``reload`` (see the module doc)."""
        mode, start = self.mode, time.monotonic()
        self._say(mode, "pending", version)
        paused = False
        try:
            if mode in ("drain", "abort"):  # abort: the flights see the record and leave
                self._wait_for(lambda: self._alive()[0] == 0, f"requests in flight to end ({mode})")
            else:  # keep: requests that are not streamed end first
                self._wait_for(lambda: self._alive()[2] == 0, "unstreamed requests in flight to end")
            engine.pause(mode)
            paused = True
            reload()
            engine.reset(running=mode == "keep")
            if mode == "keep":  # every flight counts its old tokens, quiet since the pause
                self._say(mode, "loaded", version)
                self._wait_for(lambda: self._alive()[1] == 0, "requests in flight to count their tokens")
            self._raise(keys=[self.served_key], args=[version])  # before anything samples again
        finally:
            try:  # through a failover too: requests wait for this record until it expires
                retrying(
                    lambda: self.client.delete(self.update_key, self.acks_key),
                    what=f"ending the update of {self.url}",
                    give_up_after=CLEANUP_WAIT,
                )
            finally:
                if paused:
                    engine.resume()
                self.last_stall = time.monotonic() - start

    def _say(self, mode: str, state: str, version: int) -> None:
        self.client.set(self.update_key, f"{mode}:{state}:{version}", px=int(self.lock_seconds * 1000))

    def _alive(self) -> tuple[int, int, int]:
        alive, unacked, whole = self._left(keys=[self.readers_key, self.acks_key])
        return int(alive), int(unacked), int(whole)

    def _wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.lock_seconds
        while not done():
            if time.monotonic() > deadline:
                raise SamplerError(f"{self.url}: waited {self.lock_seconds:.0f}s for {what}")
            time.sleep(self.poll)

    def _take_lock(self) -> bool:
        if self.client.set(self.lock_key, self.token, nx=True, px=int(self.lock_seconds * 1000)):
            return True
        return self.client.get(self.lock_key) == self.token.encode()  # taken by a lost reply
