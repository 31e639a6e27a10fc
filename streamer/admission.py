"""Bounded staleness by admission (the AReaL rule), checked and counted atomically.

A group may start only while ``admitted < (max_staleness + version + 1) * groups_per_step``.
``admitted`` counts groups started and not released; the trainer releases the slot of every
group it rejects, a producer the slot of a group it did not publish. The trainer writes
the limits it trains with into ``…:limits`` so producers cannot disagree with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from streamer.keys import Keys

_ADMIT = """
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
local staleness = tonumber(redis.call('HGET', KEYS[3], 'max_staleness') or ARGV[1])
local per_step = tonumber(redis.call('HGET', KEYS[3], 'groups_per_step') or ARGV[2])
if admitted < (staleness + version + 1) * per_step then
  return redis.call('INCR', KEYS[1])
end
return 0
"""


class Admission:
    def __init__(self, client: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int):
        self.client, self.keys = client, keys
        self.defaults = (max_staleness, groups_per_step)
        self._script = client.register_script(_ADMIT)

    def try_admit(self) -> bool:
        keys = [self.keys.admitted, self.keys.version, self.keys.limits]
        return bool(self._script(keys=keys, args=list(self.defaults)))

    def wait(self, stop: Callable[[], bool] = lambda: False, poll: float = 0.05) -> float | None:
        """Block until a slot is granted; returns seconds waited, or None if ``stop()``."""
        start, delay = time.monotonic(), poll
        while not self.try_admit():
            if stop():
                return None
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        return time.monotonic() - start

    def release(self, n: int = 1, pipe=None) -> None:
        """Give back ``n`` slots (in ``pipe`` when the caller needs it atomic with an ack)."""
        (pipe or self.client).decrby(self.keys.admitted, n)

    def publish_limits(self, *, max_staleness: int, groups_per_step: int) -> None:
        self.client.hset(
            self.keys.limits,
            mapping={"max_staleness": max_staleness, "groups_per_step": groups_per_step},
        )

    def snapshot(self) -> dict[str, int]:
        admitted, version = self.client.mget(self.keys.admitted, self.keys.version)
        return {"admitted": int(admitted or 0), "version": int(version or 0)}
