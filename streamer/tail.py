"""Following a stream with plain XREAD, no consumer group: the policy stream's readers.

Nothing is acknowledged and nothing is owned: every reader sees every entry after its
cursor. Group consumers, which share a stream's entries, are :class:`streamer.bus.Consumer`.
"""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

import redis

from schemas import DecodeError
from streamer.bus import as_str, entry_event

log = logging.getLogger(__name__)

T = TypeVar("T")


class Tail(Generic[T]):
    """Follows a stream with plain XREAD (no group): the policy stream's readers.

    Entries that do not decode are logged once and skipped (a plain reader owns nothing
    to acknowledge; the writer's bug is for the dead-letter stream of a group consumer).
    """

    def __init__(self, client: redis.Redis, stream: str, *, as_type: type[T], last_id: str = "0"):
        self.client, self.stream, self.as_type, self.last_id = client, stream, as_type, last_id

    def latest(self) -> T | None:
        """The newest event (or None), also moving the cursor to it."""
        rows = self.client.xrevrange(self.stream, count=1)
        if not rows:
            return None
        entry_id, fields = rows[0]
        self.last_id = as_str(entry_id)
        return self._decode(self.last_id, fields)

    def take(self, entry_id: str, fields: dict) -> T | None:
        """An entry read elsewhere (a script's reply): the newest event now (or None)."""
        self.last_id = entry_id
        return self._decode(entry_id, fields)

    def poll(self, block: float = 0.0, count: int = 100) -> list[T]:
        resp = self.client.xread(
            {self.stream: self.last_id}, count=count, block=int(block * 1000) if block > 0 else None
        )
        out = []
        for entry_id, fields in resp[0][1] if resp else []:
            self.last_id = as_str(entry_id)
            event = self._decode(self.last_id, fields)
            if event is not None:
                out.append(event)
        return out

    def _decode(self, entry_id: str, fields: dict) -> T | None:
        try:
            return entry_event(fields, self.as_type)
        except DecodeError as e:
            log.error("%s %s: skipping undecodable entry: %s", self.stream, entry_id, e.reason)
            return None
