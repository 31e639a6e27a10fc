"""Row leases and admission slots: the one home of the invariant that every row is published
at most once, none is lost, and every admission slot is taken and given back exactly once.

**Leases.** A producer claims a *ticket* (see :class:`producers.dataset.Order`) in one Lua script:
first it sweeps leases that expired (their producer died or stalled) onto ``…:requeue``,
then takes the oldest requeued ticket, else ``INCR``s ``…:cursor``. The lease lives in
``…:leases`` (ZSET ticket -> expiry, server time) and ``…:lease_owner`` (HASH ticket ->
producer id); the holder renews it while it works.

Every later step checks ownership inside the same script that acts, so a producer whose
lease was swept cannot publish a row that someone else now holds:

- :meth:`Leases.publish` XADDs the group *and* drops the lease atomically (a crash before
  it leaves the row leased, to be re-issued; after it, the row is done);
- :meth:`Leases.finish` drops the lease without publishing (the group was dropped);
- :meth:`Leases.hand_back` requeues the ticket at the front (shutdown, sampler failure).

Admission slots are tied to leases as well: the producer's admission
(``Admission.try_admit(ticket, owner)``) records that a ticket holds a slot
(``keys.lease_slots``), in the script that takes it, and whoever ends a lease without
publishing (hand back, finish, or the sweep of a dead producer's lease) gives the slot
back, so a crashed producer cannot leak admission capacity. Publishing moves the slot to
the entry (``keys.held_slots``); the trainer gives it back (:meth:`Admission.release`).

**Admission.** A group may start only while ``in_flight < (max_staleness + 1) * groups_per_step``, where
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
  ticket in the script that publishes it (:meth:`Leases.publish`);
- :meth:`Admission.release` (:meth:`Admission.reject`) gives back the slots of entries the
  trainer trained, rejected or dead-lettered: ``SREM`` == 1 then ``DECR``, so a repeat, or
  an entry that never held a slot (published by hand, a fuzzer), changes nothing. The
  counter cannot go negative.

:meth:`Admission.reconcile` (trainer start) drops owners whose entries are gone or already
acknowledged and sets the counter to the owners' count, which also repairs a run whose
counter a bug, an operator or an older version left wrong.

Which script touches which key of a run (W writes, R reads; every key shares the run's hash
tag, so each script runs on one node of a cluster):

    script      cursor leases owner requeue lease_slots admitted held_slots attempts traj
    _CLAIM      W      W      W     W       W           W (DECR) .          W        .
    _RENEW      .      W      R     .       .           .        .          .        .
    _ADMIT      .      .      R     .       W           W (INCR) .          .        .
    _PUBLISH    .      W      W     .       W           .        W          W        W (XADD)
    _END        .      W      W     W       W           W (DECR) .          W        .
    _RELEASE    .      .      .     .       .           W (DECR) W          .        W (XACK)
    _RECONCILE  .      .      .     .       R           W (SET)  W          .        R

(``attempts`` is ``row_attempts`` and ``row_errors``; ``_CLAIM`` also writes ``skipped_rows``;
``_ADMIT`` reads ``limits``; ``_PUBLISH`` increments ``rollout_step`` and reads ``version``;
``_RELEASE`` counts rejections in ``rejected_since_step``.) The
one Python twin of the admission rule is :func:`admission_limit`, which `streamer status` uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import redis

from streamer.bus import FIELD, as_str
from streamer.connection import TRANSIENT
from streamer.errors import LeaseLost
from streamer.keys import Keys
from streamer.values import DataError

EXHAUSTED = -1  # every ticket of the configured epochs is claimed and no lease is open
WAIT = -2  # no ticket now, but open leases may still expire and be re-issued

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: cursor leases owner requeue slots admitted attempts errors skipped
# ARGV: owner lease_seconds limit(-1 = none) sweep_batch max_attempts(0 = no limit)
# A lease that expired counts as a failed attempt (its producer died or stalled on the row);
# a requeued ticket that failed max_attempts times is skipped with its last error as reason.
_CLAIM = (
    _NOW
    + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, ARGV[4])
for _, t in ipairs(expired) do
  redis.call('ZREM', KEYS[2], t)
  redis.call('HDEL', KEYS[3], t)
  if redis.call('SREM', KEYS[5], t) == 1 then redis.call('DECR', KEYS[6]) end
  redis.call('HINCRBY', KEYS[7], t, 1)
  if redis.call('HEXISTS', KEYS[8], t) == 0 then
    redis.call('HSET', KEYS[8], t, 'the lease expired: its producer died or stalled on it')
  end
  redis.call('RPUSH', KEYS[4], t)
end
local max_attempts = tonumber(ARGV[5])
local ticket = redis.call('LPOP', KEYS[4])
while ticket and max_attempts > 0 and tonumber(redis.call('HGET', KEYS[7], ticket) or '0') >= max_attempts do
  local why = redis.call('HGET', KEYS[8], ticket) or 'failed'
  redis.call('HSET', KEYS[9], ticket, max_attempts .. ' attempts failed; last: ' .. why)
  redis.call('HDEL', KEYS[7], ticket)
  redis.call('HDEL', KEYS[8], ticket)
  ticket = redis.call('LPOP', KEYS[4])
end
if not ticket then
  local limit = tonumber(ARGV[3])
  if limit >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= limit then
    if redis.call('ZCARD', KEYS[2]) == 0 then return -1 end
    return -2
  end
  ticket = redis.call('INCR', KEYS[1]) - 1
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ticket)
redis.call('HSET', KEYS[3], ticket, ARGV[1])
return tonumber(ticket)
"""
)

# KEYS: leases owner ; ARGV: ticket owner lease_seconds
_RENEW = (
    _NOW
    + """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# KEYS: traj leases owner slots held attempts errors rollout_step version
# ARGV: ticket owner field payload
# The ticket's admission slot moves to the published entry, which the trainer releases; the
# group gets the next rollout step, and the reply carries the current policy version (the
# producer's metrics event needs both: one round trip instead of three). A rollout step that
# is not a number is an error before anything is written.
_PUBLISH = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return false end
local step = redis.call('GET', KEYS[8])
if step and not string.match(step, '^%d+$') then
  return redis.error_reply('ERR ' .. KEYS[8] .. ' is not a number')
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
if redis.call('SREM', KEYS[4], ARGV[1]) == 1 then redis.call('SADD', KEYS[5], id) end
return {id, redis.call('INCR', KEYS[8]), redis.call('GET', KEYS[9]) or false}
"""

# KEYS: leases owner slots admitted requeue attempts errors ; ARGV: ticket owner requeue(0/1) error
# With an error the hand-back counts as a failed attempt; finishing a row forgets its failures.
_END = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if redis.call('SREM', KEYS[3], ARGV[1]) == 1 then redis.call('DECR', KEYS[4]) end
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
  redis.call('HSET', KEYS[7], ARGV[1], ARGV[4])
elseif ARGV[3] == '0' then
  redis.call('HDEL', KEYS[6], ARGV[1])
  redis.call('HDEL', KEYS[7], ARGV[1])
end
if ARGV[3] == '1' then redis.call('LPUSH', KEYS[5], ARGV[1]) end
return 1
"""


# KEYS: attempts errors skipped requeue ; ARGV: tickets -> how many were un-skipped
_FORGIVE = """
local unskipped = 0
for _, t in ipairs(ARGV) do
  redis.call('HDEL', KEYS[1], t)
  redis.call('HDEL', KEYS[2], t)
  if redis.call('HDEL', KEYS[3], t) == 1 then
    redis.call('LPUSH', KEYS[4], t)
    unskipped = unskipped + 1
  end
end
return unskipped
"""

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

# KEYS: held admitted traj rejected [fence] ; ARGV: group ('' = no ack), trained ('1': clear
# the rejection counts), then (entry id, reason ('' = not rejected)) pairs [, then the
# trainer's fencing token]. Returns the slots given back; -1, having done nothing, when the
# trainer's run was taken over (streamer.trainer_lease). With a group the entries are
# acknowledged by it in the same script: a script, not a MULTI with EVALSHA in it, because a
# cluster client refuses scripts inside a pipeline.
_RELEASE = """
local last = #ARGV
if #KEYS == 5 then
  local fence = redis.call('GET', KEYS[5])
  if fence and fence ~= ARGV[last] then return -1 end
  last = last - 1
end
local n = 0
if ARGV[2] == '1' then redis.call('DEL', KEYS[4]) end
for i = 3, last, 2 do
  if ARGV[1] ~= '' then redis.call('XACK', KEYS[3], ARGV[1], ARGV[i]) end
  if ARGV[i + 1] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[i + 1], 1) end
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


class Admission:
    def __init__(
        self, client: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int, fence=None
    ):
        self.client, self.keys = client, keys
        self.fence = fence  # the trainer's lease: its releases and acks check its fencing token
        self.defaults = (max_staleness, groups_per_step)
        self._script = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._reconcile = client.register_script(_RECONCILE)

    def try_admit(self, ticket: int | None = None, owner: str = "") -> bool:
        """Take a slot if the rule allows; with ``ticket``, as that lease's (LeaseLost if gone).

        Without a ticket the slot has no owner to give it back (tests and benchmarks only).
        """
        keys, args = [self.keys.admitted, self.keys.limits], list(self.defaults)
        if ticket is not None:
            keys, args = keys + [self.keys.lease_owner, self.keys.lease_slots], args + [ticket, owner]
        try:
            granted = int(self._script(keys=keys, args=args))
        except TRANSIENT:  # a cluster that is down answers CLUSTERDOWN, a ResponseError too
            raise
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

    def release(self, entry_ids: Iterable[str], *, trained: bool = False) -> int:
        """Give back the slots these trajectory entries hold (each at most once, ever); with
        ``trained`` (a step trained them), also clear the rejections counted since the last
        step. Idempotent, so a retry after a lost reply is safe. Returns the slots given back."""
        return self._release_script("", [(i, "") for i in entry_ids], trained=trained)

    def reject(self, rejected: Iterable[tuple[str, str]], *, group: str) -> int:
        """(entry id, reason) pairs: acknowledge each for ``group``, count its reason (for
        `streamer status`) and give back its slot, atomically. A retry may count a reason
        twice; the slots and acks stay exact."""
        return self._release_script(group, list(rejected), trained=False)

    def _release_script(self, group: str, pairs: list[tuple[str, str]], *, trained: bool) -> int:
        if not pairs and not trained:
            return 0
        k = self.keys
        keys = [k.held_slots, k.admitted, k.traj, k.rejected_since_step]
        args = [group, "1" if trained else "0", *(x for pair in pairs for x in pair)]
        if self.fence is not None:
            keys, args = [*keys, self.fence.key], [*args, self.fence.token]
        released = int(self._release(keys=keys, args=args))
        if released < 0:
            raise self.fence.fenced()
        return released

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


class Published(NamedTuple):
    entry_id: str  # the group's trajectory entry
    rollout_step: int  # its step on the rollout axis (one per published group, run-wide)
    version: bytes | None  # the policy version key as the server held it (unparsed)


class Leases:
    """Claims, renews and ends row leases of one producer (``owner``)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        owner: str,
        lease_seconds: float,
        total_tickets: int | None = None,
        sweep_batch: int = 100,
        max_attempts: int = 0,
    ):
        self.client, self.keys, self.owner = client, keys, owner
        self.lease_seconds, self.total_tickets = lease_seconds, total_tickets
        self.sweep_batch = sweep_batch
        self.max_attempts = max_attempts  # failed attempts before a row is skipped; 0 = never
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._publish = client.register_script(_PUBLISH)
        self._end = client.register_script(_END)
        self._forgive = client.register_script(_FORGIVE)

    def claim(self) -> int:
        """A ticket (>= 0) now leased to us, or :data:`EXHAUSTED` / :data:`WAIT`."""
        k = self.keys
        limit = -1 if self.total_tickets is None else self.total_tickets
        return int(
            self._claim(
                keys=[
                    *(k.cursor, k.leases, k.lease_owner, k.requeue, k.lease_slots, k.admitted),
                    *(k.row_attempts, k.row_errors, k.skipped_rows),
                ],
                args=[self.owner, self.lease_seconds, limit, self.sweep_batch, self.max_attempts],
            )
        )

    def renew(self, ticket: int) -> bool:
        """Push the lease's expiry out; False when it is no longer ours."""
        k = self.keys
        return bool(
            self._renew(keys=[k.leases, k.lease_owner], args=[ticket, self.owner, self.lease_seconds])
        )

    def publish(self, ticket: int, payload: bytes) -> Published | None:
        """XADD ``payload`` to the trajectory stream and end the lease, atomically.

        Returns what was published, or None (nothing was) when the lease was lost.
        """
        k = self.keys
        try:
            reply = self._publish(
                keys=[
                    *(k.traj, k.leases, k.lease_owner, k.lease_slots, k.held_slots),
                    *(k.row_attempts, k.row_errors, k.rollout_step, k.version),
                ],
                args=[ticket, self.owner, FIELD, payload],
            )
        except TRANSIENT:
            raise
        except redis.exceptions.ResponseError as e:  # checked before anything is written
            raise DataError(f"publishing: {e}") from None
        if reply is None:
            return None
        entry, step, version = reply
        return Published(as_str(entry), int(step), version)

    def finish(self, ticket: int) -> bool:
        """End the lease without publishing (the row is done for this epoch); frees its slot."""
        return self._end_lease(ticket, requeue=False)

    def hand_back(self, ticket: int, *, error: str = "") -> bool:
        """End the lease and requeue the ticket first in line; frees its slot.

        With ``error`` (the row's work failed) it counts as a failed attempt: after
        ``max_attempts`` of them the row is skipped instead of handed out again.
        """
        return self._end_lease(ticket, requeue=True, error=error)

    def forgive(self, tickets: Iterable[int]) -> int:
        """Forget the failed attempts of ``tickets`` (their failures were not theirs: every row
        failed the same way); one skipped for them is handed out again. Returns how many were
        skipped."""
        k = self.keys
        return int(
            self._forgive(
                keys=[k.row_attempts, k.row_errors, k.skipped_rows, k.requeue], args=sorted(set(tickets))
            )
        )

    def _end_lease(self, ticket: int, *, requeue: bool, error: str = "") -> bool:
        k = self.keys
        return bool(
            self._end(
                keys=[
                    k.leases,
                    k.lease_owner,
                    k.lease_slots,
                    k.admitted,
                    k.requeue,
                    k.row_attempts,
                    k.row_errors,
                ],
                args=[ticket, self.owner, int(requeue), error[:500]],
            )
        )
