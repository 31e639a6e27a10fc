"""The dataset position: what a trainer checkpoint records of the row claims, and its restore
when the server lost it.

Producers claim rows by global *ticket* (streamer/admission.py): ``…:cursor`` is the next
new ticket, so it holds both the epoch (``ticket // rows``) and the place in it
(``ticket % rows``, through the epoch's seeded order: producers/dataset.py). Tickets below
it that are handed out but not finished sit in ``…:leases`` (being worked on) or
``…:requeue`` (handed back, to be issued first). A checkpoint records the cursor and those
open tickets (:func:`read`); a trainer that starts on a server that lost its data (no
cursor, or the run's marker gone) puts them back (:func:`restore`), so the run continues
where the checkpoint left it instead of from row 0 of epoch 0, and no row that was open
is lost. Groups published but not yet covered by the checkpoint are lost with the server:
their rows count as done for that epoch.
"""

from __future__ import annotations

import logging

import msgspec
import redis

from streamer.connection import retrying
from streamer.errors import ServerError
from streamer.keys import Keys

log = logging.getLogger(__name__)


class DataPosition(msgspec.Struct, frozen=True, kw_only=True):
    cursor: int  # the next new ticket: epoch = cursor // rows, row = the epoch's order[cursor % rows]
    open_tickets: list[int] = []  # claimed below the cursor, not finished (leased or requeued)


# KEYS: cursor requeue leases ; ARGV: cursor ticket...
# The cursor only moves forward (producers that claimed on the emptied server keep their
# tickets); an open ticket goes back to the requeue unless it is leased or queued already.
_RESTORE = """
local cursor = tonumber(redis.call('GET', KEYS[1]) or '0')
if cursor == nil then return redis.error_reply('ERR ' .. KEYS[1] .. ' is not a number') end
if tonumber(ARGV[1]) > cursor then redis.call('SET', KEYS[1], ARGV[1]) end
local queued = 0
for i = 2, #ARGV do
  local t = ARGV[i]
  if redis.call('ZSCORE', KEYS[3], t) == false and redis.call('LPOS', KEYS[2], t) == false then
    redis.call('RPUSH', KEYS[2], t)
    queued = queued + 1
  end
end
return queued
"""


def read(client: redis.Redis, keys: Keys, *, give_up_after: float | None = None) -> DataPosition | None:
    """The run's dataset position as the server has it now (one round trip, retried through an
    outage); None (logged) when the server stayed away past ``give_up_after`` seconds."""

    def once() -> tuple:
        pipe = client.pipeline(transaction=True)
        pipe.get(keys.cursor)
        pipe.lrange(keys.requeue, 0, -1)
        pipe.zrange(keys.leases, 0, -1)
        return pipe.execute()

    try:
        cursor, requeued, leased = retrying(
            once, what="reading the dataset position", give_up_after=give_up_after
        )
    except ServerError as e:
        log.warning("the checkpoint records no dataset position: %s", e)
        return None
    tickets = sorted({int(t) for t in [*requeued, *leased]})
    return DataPosition(cursor=int(cursor or 0), open_tickets=tickets)


def lost(client: redis.Redis, keys: Keys, saved: DataPosition | None) -> bool:
    """Whether the server lost a position ``saved`` by a checkpoint: the cursor is gone (or
    behind the checkpoint's) while the checkpoint had claimed rows."""
    if saved is None or saved.cursor == 0:
        return False
    current = client.get(keys.cursor)
    return current is None or int(current) < saved.cursor


def recover(client: redis.Redis, keys: Keys, saved: DataPosition | None) -> int | None:
    """:func:`restore` ``saved`` where the server :func:`lost` it: the open tickets requeued,
    or None when the server still has its position."""
    return restore(client, keys, saved) if lost(client, keys, saved) else None


def restore(client: redis.Redis, keys: Keys, saved: DataPosition) -> int:
    """Put ``saved`` back: the cursor forward to it, its open tickets requeued; how many were."""
    script = client.register_script(_RESTORE)
    args = [saved.cursor, *saved.open_tickets]
    return int(script(keys=[keys.cursor, keys.requeue, keys.leases], args=args))
