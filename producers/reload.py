"""One reload per version for producers that share an inference server.

Producers pointed at the same ``producer.remote_url`` would otherwise each POST their own
reload per version, in any order, and stamp samples with their own view of the version:
two reloads landing out of order leave the server on older weights than the stamp says.

Instead, per server (keyed by a digest of its URL) and version, one producer wins a Redis
lock (``SET NX PX`` with a token), reloads, and records the version the server now serves
(``…:served:<server>``, only ever raised, in one script); the others wait for that record.
Every producer then stamps its samples with the *recorded* version, which the server had
confirmed loading before the record was written: a sample is never stamped with a version
the server did not yet hold. (A reload that lands while a request is being generated makes
that sample's true weights newer than its stamp: the error is on the safe side for the
staleness window.) Reloads only move forward: a producer that sees the server already at
or past a version loads nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable

import redis

from producers.samplers import SamplerError
from streamer.keys import Keys

log = logging.getLogger(__name__)

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


def server_id(url: str) -> str:
    """A short stable name for an inference server (its normalised URL, digested)."""
    return hashlib.sha256(url.rstrip("/").lower().encode()).hexdigest()[:16]


class SharedReload:
    """Elects one reloader per version of one shared server; the others wait for its record."""

    def __init__(self, client: redis.Redis, keys: Keys, url: str, *, lock_seconds: float, poll: float = 0.05):
        sid = server_id(url)
        self.client, self.url = client, url
        self.served_key, self.lock_key = keys.served(sid), keys.reload_lock(sid)
        self.lock_seconds, self.poll = lock_seconds, poll
        self._raise = client.register_script(_RAISE)
        self._release = client.register_script(_RELEASE)
        self.reloads = 0  # reloads this producer performed (the rest were someone else's)
        # this producer's lock token: a SET whose reply was lost (a server stalled, then
        # resumed) may still have taken the lock, and must not make us wait for ourselves
        self.token = uuid.uuid4().hex

    def served(self) -> int:
        raw = self.client.get(self.served_key)
        try:
            return -1 if raw is None else int(raw)
        except ValueError:
            raise SamplerError(f"{self.served_key} holds {raw!r}, not a version number") from None

    def ensure(self, version: int, reload: Callable[[], None]) -> int:
        """Make the server serve ``version`` or newer (reloading it ourselves if we win the
        lock); returns the version it now serves. Raises what ``reload`` raises."""
        deadline = time.monotonic() + 2 * self.lock_seconds
        while (served := self.served()) < version:
            if self._take_lock():
                try:
                    if (served := self.served()) < version:  # not done while we took the lock
                        reload()
                        self.reloads += 1
                        served = int(self._raise(keys=[self.served_key], args=[version]))
                        log.info("reloaded %s to version %d for every producer sharing it", self.url, version)
                    return served
                finally:
                    self._release(keys=[self.lock_key], args=[self.token])
            if time.monotonic() > deadline:
                raise SamplerError(
                    f"{self.url}: no producer confirmed version {version} within {2 * self.lock_seconds:.0f}s"
                )
            time.sleep(self.poll)  # another producer is reloading: wait for its record
        return served

    def _take_lock(self) -> bool:
        if self.client.set(self.lock_key, self.token, nx=True, px=int(self.lock_seconds * 1000)):
            return True
        return self.client.get(self.lock_key) == self.token.encode()  # taken by a lost reply
