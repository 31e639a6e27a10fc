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

from streamer.errors import StreamerError
from streamer.keys import Keys

# KEYS: admitted version limits [lease_owner lease_slots] ; ARGV: staleness per_step [ticket owner]
# With a leased ticket the slot is recorded as the lease's in the same step: a retried call
# (its first reply lost to a timeout) finds it and takes no second slot; a lease that is
# gone takes none (-1). Whoever ends the lease without publishing gives the slot back.
_ADMIT = """
if #KEYS == 5 then
  if redis.call('HGET', KEYS[4], ARGV[3]) ~= ARGV[4] then return -1 end
  if redis.call('SISMEMBER', KEYS[5], ARGV[3]) == 1 then return 1 end
end
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
local staleness = tonumber(redis.call('HGET', KEYS[3], 'max_staleness') or ARGV[1])
local per_step = tonumber(redis.call('HGET', KEYS[3], 'groups_per_step') or ARGV[2])
if admitted < (staleness + version + 1) * per_step then
  if #KEYS == 5 then redis.call('SADD', KEYS[5], ARGV[3]) end
  return redis.call('INCR', KEYS[1])
end
return 0
"""


class LeaseLost(StreamerError):
    """The row lease a slot was asked for has expired (its ticket went to someone else)."""


class Admission:
    def __init__(self, client: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int):
        self.client, self.keys = client, keys
        self.defaults = (max_staleness, groups_per_step)
        self._script = client.register_script(_ADMIT)

    def try_admit(self, ticket: int | None = None, owner: str = "") -> bool:
        """Take a slot if the rule allows; with ``ticket``, as that lease's (LeaseLost if gone)."""
        keys, args = [self.keys.admitted, self.keys.version, self.keys.limits], list(self.defaults)
        if ticket is not None:
            keys, args = keys + [self.keys.lease_owner, self.keys.lease_slots], args + [ticket, owner]
        granted = int(self._script(keys=keys, args=args))
        if granted < 0:
            raise LeaseLost(f"the lease on ticket {ticket} is no longer {owner}'s")
        return granted > 0

    def wait(
        self,
        stop: Callable[[], bool] = lambda: False,
        poll: float = 0.05,
        *,
        ticket: int | None = None,
        owner: str = "",
    ) -> float | None:
        """Block until a slot is granted; returns seconds waited, or None if ``stop()``."""
        start, delay = time.monotonic(), poll
        while not self.try_admit(ticket, owner):
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
