"""What a role cannot do right now, where `streamer status` shows it.

A producer whose engine is down, or that cannot load the policy version it was told
about, or whose rows all fail the same way, says so here (``…:problems``, a hash of
``who -> {"at", "what"}`` as JSON) as well as in its log, and clears its entry once it
works again. An entry stays after its process has exited: that is how `status` names
the producer that gave up and why.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis

from streamer.keys import Keys

log = logging.getLogger(__name__)

MAX_TEXT = 300  # characters of a problem kept


class Problem(msgspec.Struct, kw_only=True):
    at: float  # unix seconds when it was (last) reported
    what: str


def report(client: redis.Redis, keys: Keys, who: str, what: str) -> None:
    """Record (or refresh) ``who``'s problem; best effort: the server may be the problem."""
    try:
        client.hset(keys.problems, who, msgspec.json.encode(Problem(at=time.time(), what=what[:MAX_TEXT])))
    except redis.exceptions.RedisError as e:
        log.debug("could not record problem of %s: %s", who, e)


def clear(client: redis.Redis, keys: Keys, who: str) -> None:
    try:
        client.hdel(keys.problems, who)
    except redis.exceptions.RedisError as e:
        log.debug("could not clear problem of %s: %s", who, e)


def parse(raw: dict) -> dict[str, Problem]:
    """HGETALL of ``…:problems`` as {who: Problem}; an entry that does not decode is shown as is."""
    out = {}
    for k, v in raw.items():
        who = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        try:
            out[who] = msgspec.json.decode(v, type=Problem)
        except (msgspec.DecodeError, msgspec.ValidationError):
            out[who] = Problem(at=0.0, what=f"(undecodable entry: {bytes(v)[:80]!r})")
    return out
