"""The exporter's state as a snapshot in Redis, so the metrics stream can be trimmed.

Every ``metrics.snapshot_interval`` seconds the exporter SETs ``…:metrics_snapshot`` to its
state (counters, gauges, the run's curves, the ids of
recent events) encoded with msgspec, with the id of the last event folded in. It then
trims the metrics stream up to the *previous* snapshot's id: one interval behind, so a
reader tailing the stream (`up`'s progress view) has a whole interval to pass that point,
and a restart always finds every event after the newest snapshot. A restarted exporter
(or progress view, or `streamer plot`) loads the snapshot and replays only what follows.
No pickle: a snapshot that does not decode is ignored (logged) and the stream replayed.
"""

from __future__ import annotations

import logging
from collections import deque

import msgspec
import redis

from schemas import MetricsEvent
from streamer.bus import scan
from streamer.keys import Keys
from streamer.readmodel.history import History

log = logging.getLogger(__name__)

FORMAT = 1


class SavedState(msgspec.Struct, kw_only=True):
    format: int = FORMAT
    last_id: str  # the last metrics entry folded in ("ms-seq")
    at: float
    steps: dict[str, int]
    gauges: dict[str, float]
    counters: dict[str, float]
    labelled: list[tuple[str, str, float]]  # (sample, producer label, total)
    events: dict[str, int]
    unknown: dict[str, str]  # sanitised sample -> help
    unknown_names: list[tuple[str, str]]  # (axis, name) not in the catalog
    unknown_resolved: list[tuple[str, str, str | None]]  # (axis, name, sample or None = ignored)
    producers: dict[str, str]  # source -> label
    last_train_at: float | None
    seen: list[str]
    duplicates: int
    history: History
    set_gauges: list[tuple[str, str, float]] = []  # eval axis: (sample, set label, latest)
    sets: dict[str, str] = {}  # eval set -> label


ENCODER = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedState)


class SeenIds:
    """The ids of the last ``size`` events: a copy of one (an XADD retried after its reply
    was lost) lands within seconds of the original, so a bounded window finds it."""

    def __init__(self, size: int = 10_000, ids=()):
        self.order: deque[str] = deque(maxlen=size)
        self.ids: set[str] = set()
        for i in ids:
            self.add(i)

    def add(self, event_id: str) -> bool:
        """Remember ``event_id``; False if it was already seen ("" is never a duplicate)."""
        if not event_id:
            return True
        if event_id in self.ids:
            return False
        if len(self.order) == self.order.maxlen:
            self.ids.discard(self.order[0])
        self.order.append(event_id)
        self.ids.add(event_id)
        return True


def load(client: redis.Redis, key: str) -> SavedState | None:
    raw = client.get(key)
    if raw is None:
        return None
    try:
        snap = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.error("%s does not decode (%s): ignoring it, replaying the metrics stream", key, e)
        return None
    if snap.format != FORMAT:
        log.error("%s has format %d (this build reads %d): replaying the stream", key, snap.format, FORMAT)
        return None
    return snap


class Curves:
    """The run's :class:`History` as of now: the saved state, then every metrics event after
    it (a copy written by a retry is folded once). ``up``'s progress view keeps one and
    feeds it the events it tails; ``streamer plot`` reads the stream to its end once."""

    def __init__(self, client: redis.Redis, keys: Keys):
        snap = load(client, keys.metrics_snapshot)
        self.found = snap is not None  # the run has a saved state or at least one event
        self.history = snap.history if snap else History()
        self.seen = SeenIds(ids=snap.seen if snap else ())
        self.last_id = snap.last_id if snap else "0"  # the last event the saved state covers

    def apply(self, event: MetricsEvent | None) -> bool:
        """Fold one event; False for a copy already folded (or an entry that did not decode)."""
        self.found = True
        if event is None or not self.seen.add(event.id):
            return False
        self.history.apply(event)
        return True


def read_history(client: redis.Redis, keys: Keys) -> History | None:
    """The run's curves to the end of the metrics stream; None when the run has neither a
    saved state nor an event."""
    curves = Curves(client, keys)
    for _, event in scan(client, keys.metrics, MetricsEvent, after=curves.last_id if curves.found else "-"):
        curves.apply(event)
    return curves.history if curves.found else None
