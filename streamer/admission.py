"""Bounded staleness by admission (the AReaL rule), every slot taken and given back once.

A group may start only while ``in_flight < (max_staleness + 1) * groups_per_step``, where
``in_flight`` (the counter ``…:admitted``) counts groups admitted and not yet trained or
released. This is AReaL's ``admitted < (max_staleness + version + 1) * groups_per_step``
with the trained groups (``version * groups_per_step`` of them) taken off both sides: the
same bound while the invariant holds, and it still holds where the invariant does not — a
restart that publishes the restored weights under a new version number, a resume with a
different ``groups_per_step``, a server that lost its data.

Every slot has an owner, and the counter moves only when an owner set changes:

- a row lease: ``…:lease_slots`` (ticket) — taken by :meth:`Admission.try_admit` with the
  ticket (``SADD`` == 1 then ``INCR``), given back when the lease ends unpublished;
- a published group: ``…:held_slots`` (trajectory entry id) — the slot moves there from the
  ticket in the script that publishes it (producers/leases.py);
- :meth:`Admission.release` gives back the slots of entries the trainer trained, rejected
  or dead-lettered: ``SREM`` == 1 then ``DECR``, so a repeat, or an entry that never held a
  slot (published by hand, a fuzzer), changes nothing. The counter cannot go negative.

:meth:`Admission.reconcile` (trainer start) drops owners whose entries are gone or already
acknowledged and sets the counter to the owners' count, which also repairs a run whose
counter a bug, an operator or an older version left wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import redis

from streamer.errors import StreamerError
from streamer.keys import Keys
from streamer.values import DataError

# KEYS: admitted limits [lease_owner lease_slots] ; ARGV: staleness per_step [ticket owner]
# With a leased ticket the slot is recorded as the lease's in the same step: a retried call
# (its first reply lost to a timeout) finds it and takes no second slot; a lease that is
# gone takes none (-1). Whoever ends the lease without publishing gives the slot back.
_ADMIT = """
if #KEYS == 4 then
  if redis.call('HGET', KEYS[3], ARGV[3]) ~= ARGV[4] then return -1 end
  if redis.call('SISMEMBER', KEYS[4], ARGV[3]) == 1 then return 1 end
end
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
if admitted == nil then return redis.error_reply('ERR ' .. KEYS[1] .. ' is not a number') end
local staleness = tonumber(redis.call('HGET', KEYS[2], 'max_staleness') or ARGV[1])
local per_step = tonumber(redis.call('HGET', KEYS[2], 'groups_per_step') or ARGV[2])
if staleness == nil or per_step == nil then
  return redis.error_reply('ERR ' .. KEYS[2] .. ' holds a non-number limit')
end
if admitted < (staleness + 1) * per_step then
  if #KEYS == 4 then redis.call('SADD', KEYS[4], ARGV[3]) end
  return redis.call('INCR', KEYS[1])
end
return 0
"""

# KEYS: held admitted traj ; ARGV: group ('' = no ack) entry ids. Returns the slots given back.
# With a group the entries are acknowledged by it in the same script: a script, not a MULTI
# with EVALSHA in it, because a cluster client refuses scripts inside a pipeline.
_RELEASE = """
local n = 0
for i = 2, #ARGV do
  if ARGV[1] ~= '' then redis.call('XACK', KEYS[3], ARGV[1], ARGV[i]) end
  if redis.call('SREM', KEYS[1], ARGV[i]) == 1 then n = n + 1 end
end
if n > 0 then
  local left = redis.call('DECRBY', KEYS[2], n)
  if left < 0 then redis.call('SET', KEYS[2], 0) end
end
return n
"""

# KEYS: held admitted lease_slots traj ; ARGV: group ; drops owners whose entries are gone or
# acknowledged by the group, then sets the counter to the owners' count. Returns the count.
_RECONCILE = """
local pending = {}
local info = redis.pcall('XINFO', 'GROUPS', KEYS[4])
local last = '0-0'
if type(info) == 'table' and not info.err then
  for _, g in ipairs(info) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == ARGV[1] then last = f['last-delivered-id'] end
  end
end
local function le(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as <= bs)
end
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local keep = false
  if string.match(id, '^%d+%-%d+$') and #redis.call('XRANGE', KEYS[4], id, id) == 1 then
    if not le(id, last) then keep = true
    else keep = #redis.pcall('XPENDING', KEYS[4], ARGV[1], id, id, 1) == 1 end
  end
  if not keep then redis.call('SREM', KEYS[1], id) end
end
local n = redis.call('SCARD', KEYS[1]) + redis.call('SCARD', KEYS[3])
redis.call('SET', KEYS[2], n)
return n
"""


class LeaseLost(StreamerError):
    """The row lease a slot was asked for has expired (its ticket went to someone else)."""


class Admission:
    def __init__(self, client: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int):
        self.client, self.keys = client, keys
        self.defaults = (max_staleness, groups_per_step)
        self._script = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._reconcile = client.register_script(_RECONCILE)

    def try_admit(self, ticket: int | None = None, owner: str = "") -> bool:
        """Take a slot if the rule allows; with ``ticket``, as that lease's (LeaseLost if gone).

        Without a ticket the slot has no owner to give it back (tests and benchmarks only;
        :meth:`producers.leases.Leases.hold_slot` attaches it to a lease).
        """
        keys, args = [self.keys.admitted, self.keys.limits], list(self.defaults)
        if ticket is not None:
            keys, args = keys + [self.keys.lease_owner, self.keys.lease_slots], args + [ticket, owner]
        try:
            granted = int(self._script(keys=keys, args=args))
        except redis.exceptions.ResponseError as e:  # a counter or limit that is not a number
            raise DataError(f"admission: {e}") from None
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

    def release(self, entry_ids: Iterable[str], *, ack_group: str = "") -> int:
        """Give back the slots these trajectory entries hold (each at most once, ever); with
        ``ack_group``, acknowledge the entries for that consumer group atomically with it.
        Idempotent, so a retry after a lost reply is safe. Returns the slots given back."""
        ids = list(entry_ids)
        if not ids:
            return 0
        keys = [self.keys.held_slots, self.keys.admitted, self.keys.traj]
        return int(self._release(keys=keys, args=[ack_group, *ids]))

    def reconcile(self, group: str) -> int:
        """Drop slots of entries that are gone or acknowledged by ``group``; recount. In flight."""
        k = self.keys
        return int(self._reconcile(keys=[k.held_slots, k.admitted, k.lease_slots, k.traj], args=[group]))

    def publish_limits(self, *, max_staleness: int, groups_per_step: int) -> None:
        self.client.hset(
            self.keys.limits,
            mapping={"max_staleness": max_staleness, "groups_per_step": groups_per_step},
        )

    def snapshot(self) -> dict[str, int]:
        admitted, version = self.client.mget(self.keys.admitted, self.keys.version)
        return {"admitted": int(admitted or 0), "version": int(version or 0)}


def admission_limit(max_staleness: int, groups_per_step: int) -> int:
    """Groups that may be in flight at once."""
    return (max_staleness + 1) * groups_per_step
