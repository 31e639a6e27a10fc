"""The Lua scripts behind :mod:`streamer.admission`: each acts and checks in one atomic step.

They are assembled from a few Lua functions so that the script a producer runs per row
(:data:`CLAIM_ADMIT`: sweep, claim, admission, what the policy stream holds) and the
separate scripts (:data:`CLAIM`, :data:`ADMIT`) share one text of each rule. Every script
names its keys in a table ``k`` built from ``KEYS`` at its top.

Which script touches which key of a run (W writes, R reads; every key shares the run's hash
tag, so each script runs on one node of a cluster):

    script        cursor leases owner requeue lease_slots admitted held_slots attempts traj
    CLAIM         W      W      W     W       W           W (DECR) .          W        .
    CLAIM_ADMIT   W      W      W     W       W           W        .          W        .
    RENEW         .      W      R     .       .           .        .          .        .
    ADMIT         .      .      R     .       W           W (INCR) .          .        .
    PUBLISH       .      W      W     .       W           .        W          W        W (XADD)
    END           .      W      W     W       W           W (DECR) .          W        .
    RELEASE       .      .      .     .       .           W (DECR) W          .        W (XACK)
    RECONCILE     .      .      .     .       R           W (SET)  W          .        R

(``attempts`` is ``row_attempts`` and ``row_errors``; the claims also write ``skipped_rows``;
the admissions read ``limits``; ``CLAIM_ADMIT`` reads ``policy`` and the row records
(``rows``, ``rows_solved``, ``rows_unsolvable``, see :mod:`streamer.rows`), which
``PUBLISH`` writes, and keeps the revisits due in ``row_credit``; ``PUBLISH`` increments ``rollout_step``, reads ``version`` and may XADD
to ``metrics``; ``RELEASE`` counts rejections in ``rejected_since_step``.)
"""

from __future__ import annotations

from streamer.rows import LUA as _ROWS

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# A lease that expired counts as a failed attempt (its producer died or stalled on the row).
_SWEEP = """
local function sweep(k, now, batch)
  local expired = redis.call('ZRANGEBYSCORE', k.leases, '-inf', now, 'LIMIT', 0, batch)
  for _, t in ipairs(expired) do
    redis.call('ZREM', k.leases, t)
    redis.call('HDEL', k.owner, t)
    if redis.call('SREM', k.slots, t) == 1 then redis.call('DECR', k.admitted) end
    redis.call('HINCRBY', k.attempts, t, 1)
    if redis.call('HEXISTS', k.errors, t) == 0 then
      redis.call('HSET', k.errors, t, 'the lease expired: its producer died or stalled on it')
    end
    redis.call('RPUSH', k.requeue, t)
  end
end
"""

# The oldest requeued ticket; one that failed max_attempts times (0 = no limit) is skipped
# with its last error as the reason.
_REQUEUED = """
local function requeued(k, max_attempts)
  local ticket = redis.call('LPOP', k.requeue)
  while ticket and max_attempts > 0 and tonumber(redis.call('HGET', k.attempts, ticket) or '0') >= max_attempts do
    local why = redis.call('HGET', k.errors, ticket) or 'failed'
    redis.call('HSET', k.skipped, ticket, max_attempts .. ' attempts failed; last: ' .. why)
    redis.call('HDEL', k.attempts, ticket)
    redis.call('HDEL', k.errors, ticket)
    ticket = redis.call('LPOP', k.requeue)
  end
  return ticket
end

-- the next new ticket is the cursor; none (-1 every ticket is done, -2 open leases may come
-- back) once limit (-1 = none) tickets were handed out
local function no_new_ticket(k, limit)
  if limit >= 0 and tonumber(redis.call('GET', k.cursor) or '0') >= limit then
    if redis.call('ZCARD', k.leases) == 0 then return -1 end
    return -2
  end
  return nil
end

local function lease(k, ticket, owner, now, seconds)
  redis.call('ZADD', k.leases, now + seconds, ticket)
  redis.call('HSET', k.owner, ticket, owner)
end
"""

# With a leased ticket the slot is recorded as the lease's in the same step: a retried call
# (its first reply lost to a timeout) finds it and takes no second slot; a lease that is
# gone takes none (-1). Whoever ends the lease without publishing gives the slot back.
# Returns the slots in flight after taking one, 0 (the window is full), or nil and a reason.
_ADMIT_FN = """
local function admit(k, staleness, per_step, ticket, owner)
  if ticket ~= nil then
    if redis.call('HGET', k.owner, ticket) ~= owner then return -1 end
    if redis.call('SISMEMBER', k.slots, ticket) == 1 then return 1 end
  end
  local admitted = tonumber(redis.call('GET', k.admitted) or '0')
  if admitted == nil then return nil, k.admitted .. ' is not a number' end
  staleness = tonumber(redis.call('HGET', k.limits, 'max_staleness') or staleness)
  per_step = tonumber(redis.call('HGET', k.limits, 'groups_per_step') or per_step)
  if staleness == nil or per_step == nil then return nil, k.limits .. ' holds a non-number limit' end
  if admitted < (staleness + 1) * per_step then
    if ticket ~= nil then redis.call('SADD', k.slots, ticket) end
    return redis.call('INCR', k.admitted)
  end
  return 0
end
"""

# KEYS: cursor leases owner requeue slots admitted attempts errors skipped
# ARGV: owner lease_seconds limit(-1 = none) sweep_batch max_attempts(0 = no limit)
CLAIM = (
    _NOW
    + _SWEEP
    + _REQUEUED
    + """
local k = {cursor = KEYS[1], leases = KEYS[2], owner = KEYS[3], requeue = KEYS[4], slots = KEYS[5],
  admitted = KEYS[6], attempts = KEYS[7], errors = KEYS[8], skipped = KEYS[9]}
sweep(k, now, ARGV[4])
local ticket = requeued(k, tonumber(ARGV[5]))
if not ticket then
  local none = no_new_ticket(k, tonumber(ARGV[3]))
  if none then return none end
  ticket = redis.call('INCR', k.cursor) - 1
end
lease(k, ticket, ARGV[1], now, tonumber(ARGV[2]))
return tonumber(ticket)
"""
)

# KEYS: admitted limits [lease_owner lease_slots] ; ARGV: staleness per_step [ticket owner]
ADMIT = (
    _ADMIT_FN
    + """
local k = {admitted = KEYS[1], limits = KEYS[2], owner = KEYS[3], slots = KEYS[4]}
local granted, err = admit(k, ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if err then return redis.error_reply('ERR ' .. err) end
return granted
"""
)

# One row's claim in one round trip: sweep, take a ticket (requeued first; a new ticket whose
# row is set aside is passed over, see streamer/rows.py), lease it, try its admission slot,
# and say what the policy stream holds (its newest entry, in full when it is not the one the
# producer knows).
# KEYS: admitted cursor leases owner requeue slots attempts errors skipped limits policy
#       rows rows_solved rows_unsolvable last_look row_credit
# ARGV: owner lease_seconds limit sweep_batch max_attempts staleness per_step known_policy_id
#       window_base window defer_after defer_failed_after (0 = off) revisit_share
#       defer_pass_rate (0 = off) n_rows
# Returns {ticket (or -1 exhausted, -2 wait, -3 nothing left to teach, -4 claim again),
#   granted (as ADMIT, or a reason), cursor, passed over, solved, unsolvable,
#   newest policy id or false, its fields or false (the known one), corrupt rows...}
CLAIM_ADMIT = (
    _NOW
    + _SWEEP
    + _REQUEUED
    + _ADMIT_FN
    + _ROWS
    + """
local k = {admitted = KEYS[1], cursor = KEYS[2], leases = KEYS[3], owner = KEYS[4], requeue = KEYS[5],
  slots = KEYS[6], attempts = KEYS[7], errors = KEYS[8], skipped = KEYS[9], limits = KEYS[10],
  policy = KEYS[11], rows = KEYS[12], solved = KEYS[13], unsolvable = KEYS[14], look = KEYS[15],
  credit = KEYS[16]}
local rows_rule, n_rows = rule(ARGV[11], ARGV[12], ARGV[14]), tonumber(ARGV[15])
sweep(k, now, ARGV[4])
local corrupt, solved, unsolvable = {}, 0, 0
if rows_rule.on then
  solved, unsolvable = set_aside_counts(k, rows_rule, n_rows, corrupt)
end
local ticket, passed, granted = requeued(k, tonumber(ARGV[5])), 0, 0
local check = rows_rule
if not ticket and rows_rule.on then
  local look = last_look(k, solved + unsolvable >= n_rows, n_rows)
  if look == 'look' then check = rule(0, 0, 0) elseif look then ticket = look end
end
if not ticket then
  local got = next_row(k, tonumber(ARGV[3]), tonumber(ARGV[9]), ARGV[10], check, tonumber(ARGV[13]), corrupt)
  ticket, passed = got[1], got[2]
end
ticket = tonumber(ticket)
if ticket >= 0 then
  lease(k, ticket, ARGV[1], now, tonumber(ARGV[2]))
  local err
  granted, err = admit(k, ARGV[6], ARGV[7], ticket, ARGV[1])
  if err then granted = err end
end
local policy_id, fields = false, false
local newest = redis.call('XREVRANGE', k.policy, '+', '-', 'COUNT', 1)
if #newest > 0 then
  policy_id = newest[1][1]
  if policy_id ~= ARGV[8] then fields = newest[1][2] end
end
local reply = {ticket, granted, tonumber(redis.call('GET', k.cursor) or '0'), passed, solved, unsolvable,
  policy_id, fields}
for _, row in ipairs(corrupt) do table.insert(reply, row) end
return reply
"""
)

# KEYS: leases owner ; ARGV: ticket owner lease_seconds
RENEW = (
    _NOW
    + """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# Entries of the stream that the group has not acknowledged (pending + never read), as
# streamer.bus.unacked counts them; counted up to ``limit`` where the server cannot say.
_UNACKED = """
local function unacked(stream, group, limit)
  local info = redis.pcall('XINFO', 'GROUPS', stream)
  if type(info) ~= 'table' or info.err then return 0 end
  for _, g in ipairs(info) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then
      local lag = f['lag']
      if type(lag) ~= 'number' then
        lag = #redis.call('XRANGE', stream, '(' .. f['last-delivered-id'], '+', 'COUNT', limit)
      end
      return f['pending'] + lag
    end
  end
  return redis.call('XLEN', stream)
end

-- ``s`` with the bytes at ``at`` (1-based) replaced by ``bytes``
local function put(s, at, bytes)
  return string.sub(s, 1, at - 1) .. bytes .. string.sub(s, at + #bytes)
end
"""

# KEYS: traj leases owner slots held attempts errors rollout_step version metrics
#       rows rows_solved rows_unsolvable
# ARGV: ticket owner field payload max_unacked(-1 = no check) group
#       metrics_payload('' = none) step_at offset_at group_version row('' = none) outcome pass_rate
#       defer_after defer_failed_after defer_pass_rate
# Nothing is written when the lease is not ours ({0}), the trajectory stream has no room
# ({2}), or the rollout step or version is not a number (an error). Otherwise the group is
# XADDed and the lease ends; the ticket's admission slot moves to the entry, which the
# trainer releases; the group gets the next rollout step; the row's record takes the group's
# outcome; and the producer's metrics event (stamped, see streamer/stamp.py) gets that step
# and the version offset against the current policy version, and is XADDed.
# Returns {1, entry id, rollout step, version or false, corrupt row or false}.
PUBLISH = (
    _UNACKED
    + _ROWS
    + """
local k = {traj = KEYS[1], leases = KEYS[2], owner = KEYS[3], slots = KEYS[4], held = KEYS[5],
  attempts = KEYS[6], errors = KEYS[7], step = KEYS[8], version = KEYS[9], metrics = KEYS[10],
  rows = KEYS[11], solved = KEYS[12], unsolvable = KEYS[13]}
if redis.call('HGET', k.owner, ARGV[1]) ~= ARGV[2] then return {0} end
local limit = tonumber(ARGV[5])
if limit >= 0 and unacked(k.traj, ARGV[6], limit) >= limit then return {2} end
local step = redis.call('GET', k.step)
if step and not string.match(step, '^%d+$') then
  return redis.error_reply('ERR ' .. k.step .. ' is not a number')
end
local version = redis.call('GET', k.version)
if ARGV[7] ~= '' and version and not string.match(version, '^%d+$') then
  return redis.error_reply('ERR ' .. k.version .. ' is not a number')
end
local id = redis.call('XADD', k.traj, '*', ARGV[3], ARGV[4])
redis.call('ZREM', k.leases, ARGV[1])
redis.call('HDEL', k.owner, ARGV[1])
redis.call('HDEL', k.attempts, ARGV[1])
redis.call('HDEL', k.errors, ARGV[1])
if redis.call('SREM', k.slots, ARGV[1]) == 1 then redis.call('SADD', k.held, id) end
step = redis.call('INCR', k.step)
local corrupt = false
if ARGV[11] ~= '' then
  corrupt = record_group(k, ARGV[11], ARGV[12], tonumber(ARGV[13]), rule(ARGV[14], ARGV[15], ARGV[16]))
end
if ARGV[7] ~= '' then
  local offset = math.max(0, tonumber(version or '0') - tonumber(ARGV[10]))
  local event = put(ARGV[7], tonumber(ARGV[8]), struct.pack('>BI4', 206, step))
  event = put(event, tonumber(ARGV[9]), struct.pack('>Bd', 203, offset))
  redis.call('XADD', k.metrics, '*', ARGV[3], event)
end
return {1, id, step, version or false, corrupt}
"""
)

# KEYS: leases owner slots admitted requeue attempts errors ; ARGV: ticket owner requeue(0/1) error
# With an error the hand-back counts as a failed attempt; finishing a row forgets its failures.
END = """
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
FORGIVE = """
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

# KEYS: held admitted traj rejected [fence] ; ARGV: group ('' = no ack), trained ('1': clear
# the rejection counts), then (entry id, reason ('' = not rejected)) pairs [, then the
# trainer's fencing token]. Returns the slots given back; -1, having done nothing, when the
# trainer's run was taken over (streamer.trainer_lease). With a group the entries are
# acknowledged by it in the same script: a script, not a MULTI with EVALSHA in it, because a
# cluster client refuses scripts inside a pipeline.
RELEASE = """
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
RECONCILE = """
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
