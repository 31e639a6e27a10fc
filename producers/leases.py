"""Global row claiming with leases: every ticket is published at most once, and none is lost.

A producer claims a *ticket* (see :class:`producers.dataset.Order`) in one Lua script:
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
(``Admission.try_admit(ticket, owner)``, or :meth:`Leases.hold_slot` for a slot taken
separately) records that a ticket holds a slot (``keys.lease_slots``), and whoever ends a lease without
publishing (hand back, finish, or the sweep of a dead producer's lease) gives the slot
back, so a crashed producer cannot leak admission capacity. Publishing moves the slot to
the entry (``keys.held_slots``); the trainer gives it back (streamer/admission.py).
"""

from __future__ import annotations

import logging

import redis

from streamer.bus import FIELD
from streamer.keys import Keys

log = logging.getLogger(__name__)

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

# KEYS: owner slots admitted ; ARGV: ticket owner
_HOLD_SLOT = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  redis.call('DECR', KEYS[3])
  return 0
end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: traj leases owner slots held attempts errors ; ARGV: ticket owner field payload
# The ticket's admission slot moves to the published entry, which the trainer releases.
_PUBLISH = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return false end
local id = redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
if redis.call('SREM', KEYS[4], ARGV[1]) == 1 then redis.call('SADD', KEYS[5], id) end
return id
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
        self._hold = client.register_script(_HOLD_SLOT)
        self._publish = client.register_script(_PUBLISH)
        self._end = client.register_script(_END)

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

    def hold_slot(self, ticket: int) -> bool:
        """Record that ``ticket`` holds the slot just admitted; if the lease is gone, give it back."""
        k = self.keys
        return bool(self._hold(keys=[k.lease_owner, k.lease_slots, k.admitted], args=[ticket, self.owner]))

    def publish(self, ticket: int, payload: bytes) -> str | None:
        """XADD ``payload`` to the trajectory stream and end the lease, atomically.

        Returns the entry id, or None (nothing published) when the lease was lost.
        """
        k = self.keys
        entry = self._publish(
            keys=[k.traj, k.leases, k.lease_owner, k.lease_slots, k.held_slots, k.row_attempts, k.row_errors],
            args=[ticket, self.owner, FIELD, payload],
        )
        return None if entry is None else entry.decode() if isinstance(entry, bytes) else entry

    def finish(self, ticket: int) -> bool:
        """End the lease without publishing (the row is done for this epoch); frees its slot."""
        return self._end_lease(ticket, requeue=False)

    def hand_back(self, ticket: int, *, error: str = "") -> bool:
        """End the lease and requeue the ticket first in line; frees its slot.

        With ``error`` (the row's work failed) it counts as a failed attempt: after
        ``max_attempts`` of them the row is skipped instead of handed out again.
        """
        return self._end_lease(ticket, requeue=True, error=error)

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
