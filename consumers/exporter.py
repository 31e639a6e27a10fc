"""`streamer metrics`: the Prometheus exporter of a run.

It folds the run's ``metrics`` stream into series on three step axes kept apart
(``streamer_train_*``, ``streamer_rollout_*``, ``streamer_eval_*``, each with its
``streamer_{axis}_step``), samples stream health from the server every
``metrics.health_interval`` (the same :func:`streamer.status.snapshot` that
``streamer status`` prints), and serves ``/metrics`` and ``/healthz``.

Event-sourced state. Everything served from events is a pure fold of the metrics
stream (:class:`State`). On start the exporter replays the stream from its first entry
with XRANGE, then joins its consumer group (``metrics``) for new entries; entries at or
below the replayed id are acknowledged without being applied again. A restart therefore
rebuilds the same counter totals instead of resetting them. For this to hold the metrics
stream is never trimmed (100 k events of every catalog name take ~60 MB and replay in
~3 s on one core). Run one exporter per run: a second instance in the same group would see only
part of the new events.

Naming. Gauges in the catalog (:mod:`schemas.metric_names`) serve the latest value as
``streamer_{axis}_{name}``; counters are per-event increments summed into
``streamer_{axis}_{name}_total``. Rollout counters carry one bounded label, ``producer``
(the id after ``producer-`` in the event's source); after ``MAX_PRODUCER_LABELS``
distinct ids, further producers are counted under ``producer="other"``. Unknown names
are exported as sanitised gauges (at most ``MAX_UNKNOWN_NAMES``), or ignored when they
would collide with a defined series or use a reserved suffix; either way one log line
per name, never a crash. :data:`SERIES` lists every series the exporter defines; the
dashboard check (``ops/dashboards.py --check``) imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from schemas import DecodeError, MetricsEvent, decode
from schemas.metric_names import AXES
from streamer.bus import FIELD, TRANSIENT, Consumer, connect
from streamer.config import RunConfig
from streamer.errors import ConfigError
from streamer.keys import METRICS_GROUP, Keys
from streamer.status import Snapshot, snapshot

log = logging.getLogger(__name__)

MAX_PRODUCER_LABELS = 32  # distinct `producer` label values; later producers count as "other"
MAX_UNKNOWN_NAMES = 64  # unlisted metric names exported (sanitised) before the rest are ignored
CONSUMER_NAME = "exporter"  # stable, so a restarted exporter reads its own pending entries first
REPLAY_CHUNK = 1000
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
                out[f"streamer_{axis}_{name}"] = Series("gauge", help_)
    return out


HEALTH_SERIES = {
    "streamer_stream_length": Series("gauge", "entries in the stream (XLEN)", ("stream",)),
    "streamer_stream_entries_added_total": Series("counter", "entries ever added to the stream", ("stream",)),
    "streamer_stream_group_lag": Series("gauge", "entries not yet delivered to the group", ("stream", "group")),
    "streamer_stream_group_pending": Series("gauge", "entries delivered, not acknowledged", ("stream", "group")),
    "streamer_stream_group_entries_read_total": Series("counter", "entries the group has read", ("stream", "group")),
    "streamer_stream_group_consumers": Series("gauge", "consumers in the group", ("stream", "group")),
    "streamer_dead_letters_total": Series("counter", "entries moved to the dead-letter stream"),
    "streamer_policy_version": Series("gauge", "newest policy version on the policy stream"),
    "streamer_policy_age_seconds": Series("gauge", "seconds since the newest policy version was published"),
    "streamer_train_seconds_since_last_step": Series("gauge", "seconds since the last trainer step"),
    "streamer_live_producers": Series("gauge", "producers with a heartbeat in the last 15 s"),
    "streamer_admitted_groups": Series("gauge", "admission slots held (groups admitted, not released)"),
    "streamer_admission_limit_groups": Series("gauge", "admission limit at the current version"),
    "streamer_exporter_events_total": Series("counter", "metrics events applied (replay included)", ("axis",)),
    "streamer_exporter_unknown_names": Series("gauge", "distinct metric names not in the catalog"),
    "streamer_exporter_health_ok": Series("gauge", "1 if the last stream-health sample succeeded"),
}

EVENT_SERIES = _event_series()
SERIES: dict[str, Series] = {**EVENT_SERIES, **HEALTH_SERIES}
"""Every series name the exporter can serve (sample names, counters with ``_total``)."""


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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
        self.events = {axis: 0 for axis in AXES}
        self.unknown: dict[str, str] = {}  # exported sanitised sample name -> help
        self.last_train_at: float | None = None
        self.unknown_names: set[tuple[str, str]] = set()  # (axis, name) not in the catalog
        self._names: dict[tuple[str, str], tuple[str, str] | None] = {}  # (axis, name) -> (sample, kind)
        self._producers: dict[str, str] = {}  # source -> label value
        self._warned: set[tuple[str, str]] = set()

    def apply(self, entry_id: str, event: MetricsEvent) -> bool:
        """Fold one event in; False (and no change) for an id already applied."""
        pid = _parse_id(entry_id)
        with self.lock:
            if pid <= self.last_id:
                return False
            self.last_id = pid
            axis = event.axis
            self.events[axis] += 1
            if axis == "rollout":
                self.steps[axis] = max(self.steps.get(axis, 0), event.step)
            else:
                self.steps[axis] = event.step
            if axis == "train":
                self.last_train_at = event.at
            for name, value in event.values.items():
                self._apply_value(axis, name, value, event.source)
            return True

    def _apply_value(self, axis: str, name: str, value: float, source: str) -> None:
        resolved = self._resolve(axis, name)
        if resolved is None:
            return
        sample, kind = resolved
        value = float(value)
        if kind == "gauge":
            self.gauges[sample] = value
        elif not math.isfinite(value) or value < 0:
            if (axis, name) not in self._warned:
                self._warned.add((axis, name))
                log.warning("%s counter %r: ignoring increment %r (must be finite and >= 0)", axis, name, value)
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
        log.warning("%s metric %r is not in schemas/metric_names.py: exported as gauge %s", axis, name, sample)
        self.unknown[sample] = f"unlisted {axis} metric {name!r} (latest value)"
        return sample, "gauge"

    def _producer(self, source: str) -> str:
        label = self._producers.get(source)
        if label is None:
            if len(self._producers) >= MAX_PRODUCER_LABELS:
                log.warning("more than %d producers: counting %r as producer=\"other\"", MAX_PRODUCER_LABELS, source)
                label = "other"
            else:
                label = source.removeprefix("producer-")[:64] or "unknown"
            self._producers[source] = label
        return label

    def families(self, now: float, health: Snapshot | None) -> list:
        """Metric families for one scrape (taken under the lock)."""
        with self.lock:
            out = [_gauge(f"streamer_{a}_step", s) for a, s in self.steps.items()]
            out += [_gauge(n, v, help_=self.unknown.get(n)) for n, v in self.gauges.items()]
            out += [_counter(n, v) for n, v in self.counters.items()]
            by_name: dict[str, CounterMetricFamily] = {}
            for (n, producer), v in self.labelled.items():
                fam = by_name.get(n) or by_name.setdefault(n, _counter(n, None, labels=["producer"]))
                fam.add_metric([producer], v)
            out += by_name.values()
            events = CounterMetricFamily("streamer_exporter_events_total", _help("streamer_exporter_events_total"), labels=["axis"])
            for axis, n in self.events.items():
                events.add_metric([axis], n)
            out += [events, _gauge("streamer_exporter_unknown_names", len(self.unknown_names))]
            last_train = self.last_train_at
        if health is not None:
            out += _health_families(health, now, last_train)
        return out


def _help(name: str) -> str:
    return SERIES[name].help


def _gauge(name: str, value: float | None, *, help_: str | None = None, labels=None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_ or _help(name), value=value, labels=labels)


def _counter(name: str, value: float | None, *, labels=None) -> CounterMetricFamily:
    return CounterMetricFamily(name, _help(name), value=value, labels=labels)


def _health_families(h: Snapshot, now: float, last_train_at: float | None) -> list:
    length = _gauge("streamer_stream_length", None, labels=["stream"])
    added = _counter("streamer_stream_entries_added_total", None, labels=["stream"])
    per_group = {n: _gauge(n, None, labels=["stream", "group"]) for n in (
        "streamer_stream_group_lag", "streamer_stream_group_pending", "streamer_stream_group_consumers")}
    read = _counter("streamer_stream_group_entries_read_total", None, labels=["stream", "group"])
    for s in h.streams:
        length.add_metric([s.name], s.length)
        added.add_metric([s.name], s.entries_added)
        for g in s.groups:
            per_group["streamer_stream_group_lag"].add_metric([s.name, g.name], g.lag)
            per_group["streamer_stream_group_pending"].add_metric([s.name, g.name], g.pending)
            per_group["streamer_stream_group_consumers"].add_metric([s.name, g.name], g.consumers)
            if g.entries_read is not None:
                read.add_metric([s.name, g.name], g.entries_read)
    out = [length, added, read, *per_group.values()]
    out += [_counter("streamer_dead_letters_total", h.dead_letters), _gauge("streamer_live_producers", h.live_producers)]
    out.append(_gauge("streamer_admitted_groups", h.admitted))
    version = h.policy.version if h.policy else 0
    if h.policy:
        out.append(_gauge("streamer_policy_version", version))
        out.append(_gauge("streamer_policy_age_seconds", max(0.0, now - h.policy.at)))
    if {"max_staleness", "groups_per_step"} <= h.limits.keys():
        limit = (h.limits["max_staleness"] + version + 1) * h.limits["groups_per_step"]
        out.append(_gauge("streamer_admission_limit_groups", limit))
    last = max([t for t in (last_train_at, h.policy.at if h.policy else None) if t is not None], default=None)
    if last is not None:
        out.append(_gauge("streamer_train_seconds_since_last_step", max(0.0, now - last)))
    return out


class _Collector:
    """Adapts the exporter's state to prometheus-client's collector protocol."""

    def __init__(self, exporter: Exporter):
        self.exporter = exporter

    def describe(self) -> list:
        return []  # the series set grows with the events; nothing to check at registration

    def collect(self):
        ex = self.exporter
        out = ex.state.families(time.time(), ex.health)
        out.append(_gauge("streamer_exporter_health_ok", 1.0 if ex.health_ok else 0.0))
        return out


class Exporter:
    """Replays and follows the metrics stream, samples health, serves /metrics and /healthz."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.keys = cfg, Keys(cfg.run.name)
        self.client = connect(
            cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="streamer-metrics"
        )
        self.state = State()
        self.health: Snapshot | None = None
        self.health_ok = False
        self.alive_at = time.monotonic()
        self.consumer: Consumer[MetricsEvent] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.http: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------ state

    def bootstrap(self) -> int:
        """Rebuild the state from the whole metrics stream, then join the consumer group."""
        state, after, applied, bad = State(), "-", 0, 0
        while rows := self.client.xrange(self.keys.metrics, min=after, count=REPLAY_CHUNK):
            for raw_id, fields in rows:
                entry_id = raw_id.decode()
                try:
                    event = decode(fields.get(FIELD, b""), MetricsEvent)
                except DecodeError:
                    bad += 1  # the group consumer dead-letters it when (or if) it reads it
                    continue
                applied += state.apply(entry_id, event)
            after = f"({rows[-1][0].decode()}"
        self.state = state
        self.consumer = Consumer(
            self.client, self.keys, self.keys.metrics, METRICS_GROUP, CONSUMER_NAME,
            as_type=MetricsEvent, cfg=self.cfg.bus,
        )  # fmt: skip
        log.info("replayed %d metrics events (%d undecodable skipped) from %s", applied, bad, self.keys.metrics)
        return applied

    def consume(self, block: float) -> int:
        """One read from the group: apply what is new, acknowledge everything read."""
        got = self.consumer.read(block=block)
        applied = sum(self.state.apply(d.id, d.event) for d in got)
        self.consumer.ack(d.id for d in got)
        return applied

    def sample_health(self) -> None:
        try:
            self.health = snapshot(self.client, self.keys)
            self.health_ok = True
        except (*TRANSIENT, redis.exceptions.ResponseError) as e:
            if self.health_ok:
                log.warning("stream health sample failed: %s", e)
            self.health_ok = False

    # ------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        """Consume and sample until ``stop`` is set; survives server outages."""
        interval, next_health, backoff = self.cfg.metrics.health_interval, 0.0, 0.1
        while not stop.is_set():
            try:
                if self.consumer is None:
                    self.bootstrap()
                if time.monotonic() >= next_health:
                    self.sample_health()
                    next_health = time.monotonic() + interval
                block = min(max(next_health - time.monotonic(), 0.05), self.cfg.bus.block_seconds, 1.0)
                self.consume(block)
                self.alive_at, backoff = time.monotonic(), 0.1
            except redis.exceptions.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("metrics stream or group vanished (run reset?): replaying from scratch")
                self.consumer = None
            except TRANSIENT as e:
                log.warning("server unavailable (%s); retrying in %.1fs", e, backoff)
                self.health_ok = False
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def healthy(self) -> bool:
        stale_after = max(10.0, 3 * self.cfg.bus.block_seconds, 2 * self.cfg.metrics.health_interval)
        return self.consumer is not None and time.monotonic() - self.alive_at < stale_after

    # ------------------------------------------------------------ http

    def serve(self) -> int:
        """Start the HTTP server in a daemon thread; returns the bound port."""
        host, port = self.cfg.metrics.host, self.cfg.metrics.port
        try:
            server_cls = _HTTPServer6 if ":" in host else ThreadingHTTPServer
            self.http = server_cls((host, port), _handler(self))
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror}; set metrics.port or --port") from None
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, name="metrics-http", daemon=True).start()
        bound = self.http.server_address[1]
        log.info("serving http://%s:%d/metrics for run %s", host, bound, self.keys.run)
        return bound

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.client.close()


class _HTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6  # metrics.host = "::" or another IPv6 address


def _handler(ex: Exporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
            path = self.path.partition("?")[0]
            if path == "/metrics":
                self._send(200, generate_latest(ex.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok = ex.healthy()
                body = {"ok": ok, "redis": ex.health_ok, "events": sum(ex.state.events.values())}
                self._send(200 if ok else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"see /metrics and /healthz\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("http: " + fmt, *args)

    return Handler


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Run the exporter until SIGTERM/SIGINT (exit 0)."""
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    exporter = Exporter(cfg)
    try:
        exporter.bootstrap()
        exporter.serve()
        exporter.run(stop)
    finally:
        exporter.close()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0
