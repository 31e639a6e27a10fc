"""The exporter's state as a snapshot in Redis, so the metrics stream can be trimmed.

Every ``metrics.snapshot_interval`` seconds the exporter SETs ``…:metrics_snapshot`` to its
:class:`~consumers.metrics_state.State` (counters, gauges, the run's curves, the ids of
recent events) encoded with msgspec, with the id of the last event folded in. It then
trims the metrics stream up to the *previous* snapshot's id: one interval behind, so a
reader tailing the stream (`up`'s progress view) has a whole interval to pass that point,
and a restart always finds every event after the newest snapshot. A restarted exporter
(or progress view, or `streamer plot`) loads the snapshot and replays only what follows.
No pickle: a snapshot that does not decode is ignored (logged) and the stream replayed.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis

from consumers.history import History
from consumers.metrics_state import SeenIds, State
from schemas.metric_names import DEFAULT_EVAL_SET
from streamer.bus import parse_id

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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedState)


def capture(state: State) -> SavedState:
    """The state as a SavedState; the caller holds ``state.lock`` until it is encoded."""
    ms, seq = state.last_id
    return SavedState(
        last_id=f"{ms}-{seq}",
        at=time.time(),
        steps=dict(state.steps),
        gauges=dict(state.gauges),
        counters=dict(state.counters),
        labelled=[(n, p, v) for (n, p), v in state.labelled.items()],
        events=dict(state.events),
        unknown=dict(state.unknown),
        unknown_names=sorted(state.unknown_names),
        unknown_resolved=[
            (a, n, None if r is None else r[0])
            for (a, n), r in state._names.items()
            if (a, n) in state.unknown_names
        ],
        producers=dict(state._producers),
        last_train_at=state.last_train_at,
        seen=list(state.seen.order),
        duplicates=state.duplicates,
        history=state.history,
        set_gauges=[(n, s, v) for (n, s), v in state.set_gauges.items()],
        sets=dict(state._sets),
    )


def restore(snap: SavedState) -> State:
    state = State()
    state.last_id = parse_id(snap.last_id)
    state.steps, state.gauges = dict(snap.steps), dict(snap.gauges)
    state.counters.update(snap.counters)
    state.labelled = {(n, p): v for n, p, v in snap.labelled}
    state.events.update(snap.events)
    state.unknown = dict(snap.unknown)
    state.unknown_names = {tuple(x) for x in snap.unknown_names}
    state._names.update({(a, n): None if s is None else (s, "gauge") for a, n, s in snap.unknown_resolved})
    state._producers = dict(snap.producers)
    state.last_train_at = snap.last_train_at
    state.seen = SeenIds(ids=snap.seen)
    state.duplicates = snap.duplicates
    state.history = snap.history
    state.set_gauges = {(n, s): v for n, s, v in snap.set_gauges}
    state._sets = dict(snap.sets)
    for name in [n for n in state.gauges if n.startswith("streamer_eval_") and n != "streamer_eval_step"]:
        state.set_gauges.setdefault((name, DEFAULT_EVAL_SET), state.gauges.pop(name))  # saved before sets
    return state


def save(client: redis.Redis, key: str, state: State) -> str:
    """SET the snapshot; the id of the last event it covers."""
    with state.lock:
        snap = capture(state)
        data = _encoder.encode(snap)
    client.set(key, data)
    return snap.last_id


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
