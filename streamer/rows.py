"""Rows that teach nothing step aside: a record per dataset row, kept next to the cursor.

GRPO learns from a group only when its rewards differ. Once a row's group always comes back
all solved (or all failed), every further group of it is rejected by the trainer's
zero-variance filter: sampling it is CPU spent on nothing. The producer knows each group's
rewards when it publishes, so the publish script updates the row's record
(``…:rows``, HASH row -> ``"g,s,p"``):

- ``g``: groups since the last useful one (rewards that differ), ``s``: how many of those
  were solved, ``p``: the recent pass rate (share of samples with a reward above 0, halved
  towards each new group's).

A group is *solved* when every sample got the same reward and it is above 0, *failed*
when every sample got the same reward of 0 or less, *useful* otherwise. A row is set aside

- as *solved* once its last ``producer.defer_after`` groups were all solved, or once a
  group was solved while its recent pass rate ``p`` (that group's included) is at least
  ``producer.defer_pass_rate``: a row nearly always right mostly draws solved groups, and
  the rare useful one between them would keep it active under the first rule alone;
- once ``producer.defer_failed_after`` groups in a row taught nothing (some failed): as
  *unsolvable*, or as *solved* when most of them were solved (a solved row that slips now
  and then teaches as little as one that never does).

``…:rows_solved`` and ``…:rows_unsolvable`` hold them, for counting. When such a row's
ticket comes up, the claim script passes it over and takes the next one, unless a revisit
is due: each active row handed out earns ``s / (1 - s)`` of a revisit
(``s`` = ``producer.revisit_share``, kept in ``…:row_credit``, at most one revisit's worth
banked beyond that), so revisits are at most that share of the rows handed out, however
many rows are set aside. A revisit notices a regression (or a row that became learnable):
one useful group makes the row active again.

The claim script maps tickets to rows with a *window* the producer sends: the rows of the
tickets from the cursor it last saw on (:meth:`producers.dataset.Order.window`). A ticket
outside the window is not handed out blind: the script answers "claim again" with the
current cursor. Requeued tickets (a failed or expired attempt) are never passed over.

When every row is set aside, the claims first hand out the next ``n_rows`` tickets whatever
their rows (``…:last_look``: one more look at about every row under the current policy). If
none of those groups taught anything, nothing is left that can teach: the claim answers so,
the producers stop, and `streamer status` and `streamer up` say it. A record that is
missing (a row in a set without one) or not a record is forgotten: the row is treated as
new (never skipped for ever) and the producer logs one warning.

A row's outcomes depend on the settings that sample and score it (:func:`outcome_settings`:
the model, the dataset, the sampling, the rollout and the reward). Producers record them
(``…:rows_settings``); a producer that starts with other settings forgets every record, so
rows set aside under a broken config (a temperature of 1e-30, a reward that always fails)
come back when it is fixed. ``streamer rows reset`` (``up --reset-rows``) forgets them by
hand. Neither touches checkpoints, versions or the dataset position.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import redis

from streamer.keys import Keys

# Lua functions of the claim and publish scripts (streamer/lease_scripts.py); ``k`` names the
# keys rows, solved, unsolvable, credit and cursor; ``rule`` is :func:`rule`'s table.
LUA = """
-- the rule of setting rows aside from three arguments: defer_after, defer_failed_after,
-- defer_pass_rate (each 0 = never)
local function rule(solved, failed, rate)
  solved, failed, rate = tonumber(solved), tonumber(failed), tonumber(rate)
  return {solved = solved, failed = failed, rate = rate, on = solved > 0 or failed > 0 or rate > 0}
end

local function parse_record(raw)  -- {g, s, p}; nil: no record; false: not a record
  if not raw then return nil end
  local g, s, p = string.match(raw, '^(%d+),(%d+),(%d*%.?%d+)$')
  g, s, p = tonumber(g), tonumber(s), tonumber(p)
  if not g or not s or not p or s > g or p > 1 then return false end
  return {g, s, p}
end

-- rule: {solved = defer_after, failed = defer_failed_after, rate = defer_pass_rate} (0: never)
local function state_of(rec, rule)  -- 'solved', 'unsolvable' or nil (active)
  if not rec then return nil end
  local g, s = rec[1], rec[2]
  if rule.solved > 0 and g >= rule.solved and s == g then return 'solved' end
  if rule.rate > 0 and g >= 1 and s == g and rec[3] >= rule.rate then return 'solved' end
  if rule.failed > 0 and g >= rule.failed and s < g then
    if 2 * s > g then return 'solved' end
    return 'unsolvable'
  end
  return nil
end

local function forget(k, row)
  redis.call('HDEL', k.rows, row)
  redis.call('SREM', k.solved, row)
  redis.call('SREM', k.unsolvable, row)
end

local function place(k, row, state)
  if state == 'solved' then redis.call('SADD', k.solved, row) else redis.call('SREM', k.solved, row) end
  if state == 'unsolvable' then redis.call('SADD', k.unsolvable, row) else redis.call('SREM', k.unsolvable, row) end
end

-- the row's state; a record that is not one is forgotten (the row is new) and reported
local function row_state(k, row, rule, corrupt)
  local rec = parse_record(redis.call('HGET', k.rows, row))
  if rec == false then
    forget(k, row)
    table.insert(corrupt, row)
  end
  return state_of(rec, rule)
end

-- the sizes of the two sets; when they cover every row, each member is checked first
local function set_aside_counts(k, rule, n_rows, corrupt)
  local solved, unsolvable = redis.call('SCARD', k.solved), redis.call('SCARD', k.unsolvable)
  if solved + unsolvable < n_rows then return solved, unsolvable end
  for _, set in ipairs({{k.solved, 'solved'}, {k.unsolvable, 'unsolvable'}}) do
    for _, row in ipairs(redis.call('SMEMBERS', set[1])) do
      local rec = parse_record(redis.call('HGET', k.rows, row))
      local n = tonumber(row)
      local state = state_of(rec, rule)
      if not rec then
        forget(k, row)
        table.insert(corrupt, row)
      elseif n == nil or n < 0 or n >= n_rows or n ~= math.floor(n) then
        forget(k, row)
      elseif state ~= set[2] then
        place(k, row, state)
      end
    end
  end
  return redis.call('SCARD', k.solved), redis.call('SCARD', k.unsolvable)
end

-- revisits banked (k.credit): each active row handed out earns share / (1 - share)
local function credit(k) return tonumber(redis.call('GET', k.credit) or '0') or 0 end

-- the next new ticket whose row is not set aside (or is revisited): {ticket, passed over};
-- -4 when the cursor left the producer's window of rows (it claims again with a new one)
local function next_row(k, limit, base, window, rule, share, corrupt)
  local passed = 0
  while true do
    local none = no_new_ticket(k, limit)
    if none then return {none, passed} end
    if not rule.on then return {redis.call('INCR', k.cursor) - 1, passed} end
    local cursor = tonumber(redis.call('GET', k.cursor) or '0')
    local i = cursor - base
    if i < 0 or 4 * i + 4 > #window then return {-4, passed} end
    local b1, b2, b3, b4 = string.byte(window, 4 * i + 1, 4 * i + 4)
    local row = b1 + 256 * b2 + 65536 * b3 + 16777216 * b4
    local state = row_state(k, row, rule, corrupt)
    redis.call('INCR', k.cursor)
    if state == nil then
      if share > 0 then
        local earned = share / (1 - share)
        redis.call('SET', k.credit, string.format('%.17g', math.min(credit(k) + earned, 1 + earned)))
      end
      return {cursor, passed}
    end
    local banked = credit(k)
    if banked >= 1 then
      redis.call('SET', k.credit, string.format('%.17g', banked - 1))
      return {cursor, passed}
    end
    -- in its set, whatever put it there: the sets' sizes decide when every row is set
    -- aside, and a row passed over but not counted would have claims walk on for ever
    place(k, row, state)
    passed = passed + 1
  end
end

-- every row set aside: before nothing is said to be left to teach, the next n_rows tickets
-- are handed out whatever their rows (a last look under the current policy). nil: some row
-- is active; 'look': hand the next ticket out; -2: the last look's groups are still out;
-- -3: nothing left to teach
local function last_look(k, done, n_rows)
  local ends = redis.call('GET', k.look)
  if not done then
    if ends then redis.call('DEL', k.look) end
    return nil
  end
  local cursor = tonumber(redis.call('GET', k.cursor) or '0')
  ends = tonumber(ends)
  if not ends then
    ends = cursor + n_rows
    redis.call('SET', k.look, ends)
  end
  if cursor < ends then return 'look' end
  if redis.call('ZCARD', k.leases) > 0 then return -2 end
  return -3
end

-- the record after one more group of the row: 'solved', 'failed' or 'useful'; returns the
-- row when its old record was not one (it starts again as new), else false
local function record_group(k, row, outcome, pass_rate, rule)
  local rec = parse_record(redis.call('HGET', k.rows, row))
  local corrupt = rec == false and row
  if rec then rec[3] = (rec[3] + pass_rate) / 2 else rec = {0, 0, pass_rate} end
  if outcome == 'useful' then
    rec[1], rec[2] = 0, 0
  else
    rec[1] = rec[1] + 1
    if outcome == 'solved' then rec[2] = rec[2] + 1 end
  end
  local raw = string.format('%d,%d,%.3f', rec[1], rec[2], rec[3])
  redis.call('HSET', k.rows, row, raw)
  -- judged as stored (the pass rate rounded), as every claim will judge it
  if rule.on then place(k, row, state_of(parse_record(raw), rule)) end
  return corrupt
end
"""


def outcome(rewards: list[float]) -> tuple[str, float]:
    """("solved" | "failed" | "useful", pass rate) of a group; ("", …) for one sample (a
    group of one is never judged by its variance, so it says nothing about the row)."""
    n = len(rewards)
    pass_rate = sum(r > 0 for r in rewards) / max(1, n)
    if n < 2:
        return "", pass_rate
    if any(r != rewards[0] for r in rewards):
        return "useful", pass_rate
    return ("solved" if rewards[0] > 0 else "failed"), pass_rate


class Rule(NamedTuple):
    """When rows step aside: ``producer.defer_after``, ``defer_failed_after``,
    ``defer_pass_rate`` (0 = never) and ``revisit_share``. The default never sets a row aside."""

    solved_after: int = 0
    failed_after: int = 0
    revisit_share: float = 0.0
    pass_rate: float = 0.0

    @property
    def on(self) -> bool:
        return self.solved_after > 0 or self.failed_after > 0 or self.pass_rate > 0


NEVER = Rule()  # rows never step aside


class RowCounts(NamedTuple):
    total: int  # rows of the dataset (0: no producer said yet)
    solved: int
    unsolvable: int
    looked: bool = False  # the last look at every row, all solved, is over (none of it taught)
    exhausted: bool = False  # every ticket of the producers' epochs is claimed and finished

    @property
    def active(self) -> int:
        return max(0, self.total - self.solved - self.unsolvable)

    @property
    def nothing_to_teach(self) -> bool:
        return self.total > 0 and self.active == 0 and self.looked  # a look starts only when done


def counts(client: redis.Redis, keys: Keys) -> RowCounts:
    """Rows active / solved / unsolvable as the server holds them (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for key in (keys.row_count, keys.last_look, keys.cursor):
        pipe.get(key)
    pipe.scard(keys.rows_solved)
    pipe.scard(keys.rows_unsolvable)
    pipe.zcard(keys.leases)
    pipe.get(keys.data_end)
    pipe.llen(keys.requeue)
    return from_replies(*pipe.execute())


def from_replies(
    total, look_ends, cursor, solved, unsolvable, leases, data_end=None, requeued=0
) -> RowCounts:
    """The counts from GET row_count, last_look, cursor; SCARD of the two sets; ZCARD leases;
    GET data_end; LLEN requeue."""
    total, look_ends, cursor, data_end = (_int(x) for x in (total, look_ends, cursor, data_end))
    looked = look_ends is not None and (cursor or 0) >= look_ends and not leases
    # a producer found no ticket left at this cursor; none was taken since, none is out
    exhausted = data_end is not None and data_end == (cursor or 0) and not leases and not requeued
    return RowCounts(total or 0, int(solved), int(unsolvable), looked, exhausted)


def exhausted(client: redis.Redis, keys: Keys, cursor: int) -> None:
    """A producer's claim found every ticket of its epochs claimed and finished at ``cursor``."""
    client.set(keys.data_end, cursor)


def _int(raw) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


# Forgets every row record when the outcome settings differ from the recorded ones.
# KEYS: rows_settings rows rows_solved rows_unsolvable last_look row_credit ; ARGV: settings
# Returns {rows set aside that were forgotten, the settings recorded before (false: none)}.
_SETTINGS = """
local old = redis.call('GET', KEYS[1])
if old == ARGV[1] then return {0, false} end
redis.call('SET', KEYS[1], ARGV[1])
if not old then return {0, false} end
local n = redis.call('SCARD', KEYS[3]) + redis.call('SCARD', KEYS[4])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return {n, old}
"""


def outcome_settings(cfg) -> dict:
    """The settings a row's outcomes depend on (a :class:`~streamer.config.RunConfig`)."""
    p, judge = cfg.producer, cfg.reward.judge
    return {
        "model": cfg.model.name_or_path,
        "dataset": p.dataset,
        # the mix numbers rows across its sources: other sources, other rows under those numbers
        **(
            {"sources": [[s.path, s.split, s.name] for s in cfg.dataset.sources]}
            if cfg.dataset.sources
            else {}
        ),
        "group_size": p.group_size,
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "rollout": p.rollout,
        "reward": p.reward,
        **({"judge": [judge.url, judge.kind, judge.model, judge.template]} if p.reward == "judge" else {}),
    }


def _keys_of_records(keys: Keys) -> list[str]:
    return [keys.rows, keys.rows_solved, keys.rows_unsolvable, keys.last_look, keys.row_credit]


def settle_settings(client: redis.Redis, keys: Keys, settings: dict) -> tuple[int, list[str]]:
    """Record ``settings``; when others were recorded, forget every row record (rows set
    aside come back). Returns (rows set aside brought back, the settings that changed)."""
    raw = json.dumps(settings, sort_keys=True)
    n, old = client.eval(_SETTINGS, 6, keys.rows_settings, *_keys_of_records(keys), raw)
    if not old:
        return 0, []
    try:
        before = json.loads(old)
    except ValueError:
        before = {}
    if not isinstance(before, dict):
        before = {}
    changed = [f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v]
    return int(n), changed or ["unreadable record"]


def reset(client: redis.Redis, keys: Keys) -> int:
    """Forget every row record: rows set aside (solved or unsolvable) are active again; how
    many were set aside."""
    pipe = client.pipeline(transaction=True)
    pipe.scard(keys.rows_solved)
    pipe.scard(keys.rows_unsolvable)
    pipe.delete(*_keys_of_records(keys))
    solved, unsolvable, _ = pipe.execute()
    return int(solved) + int(unsolvable)
