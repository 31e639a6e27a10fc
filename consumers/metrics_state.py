"""The exporter's series catalog and its event-sourced state (no I/O).

:data:`SERIES` names every series the exporter can serve; :class:`State` is the fold of
``MetricsEvent``s into gauges (latest value) and counters (sums of per-event increments),
and turns itself plus a stream-health :class:`~streamer.readmodel.health.Snapshot` into
prometheus-client metric families for one scrape. See :mod:`consumers.exporter` for the
naming rules and for how the state survives restarts.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from typing import NamedTuple

import redis
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from schemas import MetricsEvent
from schemas.metric_names import AXES, DEFAULT_EVAL_SET
from streamer.bus import parse_id
from streamer.readmodel.health import Snapshot
from streamer.readmodel.history import History
from streamer.readmodel.saved import ENCODER, SavedState, SeenIds

log = logging.getLogger(__name__)

MAX_PRODUCER_LABELS = 32  # distinct `producer` label values; later producers count as "other"
MAX_SET_LABELS = 16  # distinct eval `set` label values; later sets count as "other"
MAX_UNKNOWN_NAMES = 64  # unlisted metric names exported (sanitised) before the rest are ignored
_RESERVED = ("_total", "_created", "_count", "_sum", "_bucket", "_info")


class Series(NamedTuple):
    kind: str  # "gauge" or "counter" (the name then ends in _total)
    help: str
    labels: tuple[str, ...] = ()


def _event_series() -> dict[str, Series]:
    out = {}
    for axis, names in AXES.items():
        out[f"streamer_{axis}_step"] = Series("gauge", f"latest step of the {axis} axis")
        for name, (kind, help_) in names.items():
            if kind == "counter":
                labels = ("producer",) if axis == "rollout" else ()
                out[f"streamer_{axis}_{name}_total"] = Series("counter", help_, labels)
            else:
                out[f"streamer_{axis}_{name}"] = Series("gauge", help_, ("set",) if axis == "eval" else ())
    return out


HEALTH_SERIES = {
    "streamer_stream_length": Series("gauge", "entries in the stream (XLEN)", ("stream",)),
    "streamer_stream_entries_added_total": Series("counter", "entries ever added to the stream", ("stream",)),
    "streamer_stream_group_lag": Series(
        "gauge", "entries not yet delivered to the group", ("stream", "group")
    ),
    "streamer_stream_group_pending": Series(
        "gauge", "entries delivered, not acknowledged", ("stream", "group")
    ),
    "streamer_stream_group_entries_read_total": Series(
        "counter", "entries the group has read", ("stream", "group")
    ),
    "streamer_stream_group_consumers": Series("gauge", "consumers in the group", ("stream", "group")),
    "streamer_dead_letters_total": Series("counter", "entries moved to the dead-letter stream"),
    "streamer_policy_version": Series("gauge", "newest policy version on the policy stream"),
    "streamer_policy_age_seconds": Series("gauge", "seconds since the newest policy version was published"),
    "streamer_train_seconds_since_last_step": Series("gauge", "seconds since the last trainer step"),
    "streamer_live_producers": Series("gauge", "producers with a heartbeat in the last 15 s"),
    "streamer_admitted_groups": Series("gauge", "admission slots held (groups admitted, not released)"),
    "streamer_admission_limit_groups": Series("gauge", "admission limit at the current version"),
    "streamer_exporter_events_total": Series(
        "counter", "metrics events applied (replay included)", ("axis",)
    ),
    "streamer_exporter_unknown_names": Series("gauge", "distinct metric names not in the catalog"),
    "streamer_exporter_health_ok": Series("gauge", "1 if the last stream-health sample succeeded"),
}

EVENT_SERIES = _event_series()
SERIES: dict[str, Series] = {**EVENT_SERIES, **HEALTH_SERIES}
"""Every series name the exporter can serve (sample names, counters with ``_total``)."""


def sanitise(name: str) -> str:
    """A metric name fragment made of [a-z0-9_], no leading/trailing/double underscores."""
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9_]", "_", name.lower())).strip("_")


class State:
    """The fold of metrics events; everything /metrics serves that does not come from health."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_id = (0, 0)
        self.steps: dict[str, int] = {}  # axis -> step
        self.gauges: dict[str, float] = {}  # sample name -> latest value
        self.counters = {n: 0.0 for n, s in EVENT_SERIES.items() if s.kind == "counter" and not s.labels}
        self.labelled: dict[tuple[str, str], float] = {}  # (sample name, producer) -> total
        self.set_gauges: dict[tuple[str, str], float] = {}  # eval axis: (sample name, set) -> latest
        self.events = {axis: 0 for axis in AXES}
        self.unknown: dict[str, str] = {}  # exported sanitised sample name -> help
        self.last_train_at: float | None = None
        self.unknown_names: set[tuple[str, str]] = set()  # (axis, name) not in the catalog
        self._names: dict[tuple[str, str], tuple[str, str] | None] = {}  # (axis, name) -> (sample, kind)
        self._producers: dict[str, str] = {}  # source -> label value
        self._sets: dict[str, str] = {}  # eval set -> label value
        self._warned: set[tuple[str, str]] = set()
        self.seen = SeenIds()
        self.history = History()  # the run's curves (progress view, `streamer plot`)
        self.duplicates = 0  # copies of an event already applied (retried writes), skipped

    def apply(self, entry_id: str, event: MetricsEvent) -> bool:
        """Fold one event in; False (and no change) for an id already applied."""
        pid = parse_id(entry_id)
        with self.lock:
            if pid <= self.last_id:
                return False
            self.last_id = pid
            if not self.seen.add(event.id):
                self.duplicates += 1
                return False
            axis = event.axis
            self.events[axis] += 1
            if axis == "rollout":
                self.steps[axis] = max(self.steps.get(axis, 0), event.step)
            else:
                self.steps[axis] = event.step
            if axis == "train":
                self.last_train_at = event.at
            for name, value in event.values.items():
                self._apply_value(axis, name, value, event.source, event.eval_set)
            self.history.apply(event)
            return True

    def _apply_value(self, axis: str, name: str, value: float, source: str, eval_set: str = "") -> None:
        resolved = self._resolve(axis, name)
        if resolved is None:
            return
        sample, kind = resolved
        value = float(value)
        if kind == "gauge" and axis == "eval":
            self.set_gauges[(sample, self._set(eval_set))] = value
        elif kind == "gauge":
            self.gauges[sample] = value
        elif not math.isfinite(value) or value < 0:
            if (axis, name) not in self._warned:
                self._warned.add((axis, name))
                log.warning(
                    "%s counter %r: ignoring increment %r (must be finite and >= 0)", axis, name, value
                )
        elif SERIES[sample].labels:
            key = (sample, self._producer(source))
            self.labelled[key] = self.labelled.get(key, 0.0) + value
        else:
            self.counters[sample] += value

    def _resolve(self, axis: str, name: str) -> tuple[str, str] | None:
        key = (axis, name)
        if key in self._names:
            return self._names[key]
        known = AXES[axis].get(name)
        if known:
            kind = known[0]
            out = (f"streamer_{axis}_{name}" + ("_total" if kind == "counter" else ""), kind)
        else:
            out = self._unknown(axis, name)
        self._names[key] = out
        return out

    def _unknown(self, axis: str, name: str) -> tuple[str, str] | None:
        self.unknown_names.add((axis, name))
        sample = f"streamer_{axis}_{sanitise(name)}"
        why = None
        if sample in SERIES or sample in self.unknown or sample + "_total" in SERIES:
            why = "collides with another series"
        elif sample.endswith(_RESERVED) or sample == f"streamer_{axis}_":
            why = "has a reserved suffix or no usable characters"
        elif len(self.unknown) >= MAX_UNKNOWN_NAMES:
            why = f"more than {MAX_UNKNOWN_NAMES} unknown names"
        if why:
            log.warning("%s metric %r is not in schemas/metric_names.py and %s: ignored", axis, name, why)
            return None
        log.warning(
            "%s metric %r is not in schemas/metric_names.py: exported as gauge %s", axis, name, sample
        )
        self.unknown[sample] = f"unlisted {axis} metric {name!r} (latest value)"
        return sample, "gauge"

    def _producer(self, source: str) -> str:
        label = self._producers.get(source)
        if label is None:
            if len(self._producers) >= MAX_PRODUCER_LABELS:
                log.warning(
                    'more than %d producers: counting %r as producer="other"',
                    MAX_PRODUCER_LABELS,
                    source,
                )
                label = "other"
            else:
                label = source.removeprefix("producer-")[:64] or "unknown"
            self._producers[source] = label
        return label

    def _set(self, eval_set: str) -> str:
        label = self._sets.get(eval_set)
        if label is None:
            if len(self._sets) >= MAX_SET_LABELS:
                log.warning('more than %d eval sets: counting %r as set="other"', MAX_SET_LABELS, eval_set)
                label = "other"
            else:
                label = eval_set[:64] or DEFAULT_EVAL_SET
            self._sets[eval_set] = label
        return label

    def families(self, now: float, health: Snapshot | None) -> list:
        """Metric families for one scrape (taken under the lock)."""
        with self.lock:
            out = [gauge(f"streamer_{a}_step", s) for a, s in self.steps.items()]
            out += [gauge(n, v, help_=self.unknown.get(n)) for n, v in self.gauges.items()]
            out += [counter(n, v) for n, v in self.counters.items()]
            by_name: dict[str, CounterMetricFamily] = {}
            for (n, producer), v in self.labelled.items():
                fam = by_name.get(n) or by_name.setdefault(n, counter(n, None, labels=["producer"]))
                fam.add_metric([producer], v)
            out += by_name.values()
            by_set: dict[str, GaugeMetricFamily] = {}
            for (n, eval_set), v in self.set_gauges.items():
                if n not in by_set:
                    by_set[n] = gauge(n, None, help_=self.unknown.get(n), labels=["set"])
                by_set[n].add_metric([eval_set], v)
            out += by_set.values()
            events = counter("streamer_exporter_events_total", None, labels=["axis"])
            for axis, n in self.events.items():
                events.add_metric([axis], n)
            out += [events, gauge("streamer_exporter_unknown_names", len(self.unknown_names))]
            last_train = self.last_train_at
        if health is not None:
            out += _health_families(health, now, last_train)
        return out


def gauge(name: str, value: float | None, *, help_: str | None = None, labels=None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_ or SERIES[name].help, value=value, labels=labels)


def counter(name: str, value: float | None, *, labels=None) -> CounterMetricFamily:
    return CounterMetricFamily(name, SERIES[name].help, value=value, labels=labels)


def _health_families(h: Snapshot, now: float, last_train_at: float | None) -> list:
    length = gauge("streamer_stream_length", None, labels=["stream"])
    added = counter("streamer_stream_entries_added_total", None, labels=["stream"])
    lag = gauge("streamer_stream_group_lag", None, labels=["stream", "group"])
    pending = gauge("streamer_stream_group_pending", None, labels=["stream", "group"])
    consumers = gauge("streamer_stream_group_consumers", None, labels=["stream", "group"])
    read = counter("streamer_stream_group_entries_read_total", None, labels=["stream", "group"])
    for s in h.streams:
        length.add_metric([s.name], s.length)
        added.add_metric([s.name], s.entries_added)
        for g in s.groups:
            lag.add_metric([s.name, g.name], g.lag)
            pending.add_metric([s.name, g.name], g.pending)
            consumers.add_metric([s.name, g.name], g.consumers)
            if g.entries_read is not None:
                read.add_metric([s.name, g.name], g.entries_read)
    out = [length, added, read, lag, pending, consumers]
    out += [
        counter("streamer_dead_letters_total", h.dead_letters),
        gauge("streamer_live_producers", h.live_producers),
        gauge("streamer_admitted_groups", h.admitted),
    ]
    if h.policy:
        out.append(gauge("streamer_policy_version", h.policy.version))
        out.append(gauge("streamer_policy_age_seconds", max(0.0, now - h.policy.at)))
    if h.admission_limit is not None:
        out.append(gauge("streamer_admission_limit_groups", h.admission_limit))
    last = max([t for t in (last_train_at, h.policy.at if h.policy else None) if t is not None], default=None)
    if last is not None:
        out.append(gauge("streamer_train_seconds_since_last_step", max(0.0, now - last)))
    return out


# ---------------------------------------------------------------- saved state


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
        data = ENCODER.encode(snap)
    client.set(key, data)
    return snap.last_id
