"""`streamer metrics`: the Prometheus exporter of a run.

It folds the run's ``metrics`` stream into series on three step axes kept apart
(``streamer_train_*``, ``streamer_rollout_*``, ``streamer_eval_*``, each with its
``streamer_{axis}_step``), samples stream health from the server every
``metrics.health_interval`` (the same :func:`streamer.readmodel.health.snapshot` that
``streamer status`` prints), and serves ``/metrics`` and ``/healthz``.

Event-sourced state. Everything served from events is a pure fold of the metrics
stream (:class:`consumers.metrics_state.State`). Every ``metrics.snapshot_interval``
seconds the exporter saves that state to Redis and trims the stream behind it
(:mod:`streamer.readmodel.saved`), so the stream stays bounded however long the run; the
trim waits for the tracker's group (``tracking``) by at most ``tracking.max_lag`` entries. On start
it loads the snapshot, replays the stream after it with XRANGE, then joins its consumer
group (``metrics``) for new entries; entries at or below the replayed id are acknowledged
without being applied again. A restart therefore continues the same counter totals
instead of resetting them. Run one exporter per run: a second instance in the same group
would see only part of the new events.

Naming. Gauges in the catalog (:mod:`schemas.metric_names`) serve the latest value as
``streamer_{axis}_{name}``; counters are per-event increments summed into
``streamer_{axis}_{name}_total``. Rollout counters carry one bounded label, ``producer``
(the id after ``producer-`` in the event's source); after ``MAX_PRODUCER_LABELS`` (32)
distinct ids, further producers are counted under ``producer="other"``. Eval gauges carry
``set``, the event's eval set (``default`` when it names none; after ``MAX_SET_LABELS``
(16) distinct sets, ``set="other"``). Unknown names
are exported as sanitised gauges (at most ``MAX_UNKNOWN_NAMES``, 64), or ignored when
they would collide with a defined series or use a reserved suffix; either way one log
line per name, never a crash. :data:`SERIES` lists every series the exporter defines;
the dashboard check (``ops/dashboards.py --check``) imports it from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from consumers.metrics_state import SERIES, Series, State, gauge, restore, save
from schemas import MetricsEvent
from streamer import lifecycle
from streamer.bus import Consumer, hold_back, parse_id, scan
from streamer.config import RunConfig
from streamer.connection import TRANSIENT, connect
from streamer.errors import ConfigError
from streamer.keys import METRICS_GROUP, TRACKING_GROUP, Keys
from streamer.readmodel import saved
from streamer.readmodel.health import Snapshot, snapshot

log = logging.getLogger(__name__)

__all__ = ["SERIES", "Exporter", "Series", "State", "main"]

CONSUMER_NAME = "exporter"  # stable, so a restarted exporter reads its own pending entries first
# seconds at least between two reads of the metrics stream: its events come one a group, a
# hundred a second on the demo, and a read and an acknowledgement each cost the exporter and
# the server more than applying the event; what arrives meanwhile comes in one read (a
# quarter second later on /metrics, which a scrape every few seconds does not see)
READ_GAP = 0.25


class _Collector:
    """Adapts the exporter's state to prometheus-client's collector protocol."""

    def __init__(self, exporter: Exporter):
        self.exporter = exporter

    def describe(self) -> list:
        return []  # the series set grows with the events; nothing to check at registration

    def collect(self):
        ex = self.exporter
        out = ex.state.families(time.time(), ex.health)
        out.append(gauge("streamer_exporter_health_ok", 1.0 if ex.health_ok else 0.0))
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
        self._trim_to: str | None = None  # id of the previous snapshot: trimmed up to it next
        self.trimmed = self.snapshots = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.http: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------ state

    def bootstrap(self) -> int:
        """Rebuild the state from the snapshot and the stream after it; join the group."""
        state, after, applied, bad = State(), "-", 0, 0
        snap = saved.load(self.client, self.keys.metrics_snapshot)
        if snap is not None:
            state, after = restore(snap), snap.last_id
            self._trim_to = snap.last_id
            log.info("restored the metrics state of %s (%d events)", snap.last_id, sum(snap.events.values()))
        for entry_id, event in scan(self.client, self.keys.metrics, MetricsEvent, after=after):
            if event is None:
                bad += 1  # the group consumer dead-letters it when (or if) it reads it
            else:
                applied += state.apply(entry_id, event)
        self.state = state
        self.consumer = Consumer(
            self.client,
            self.keys,
            self.keys.metrics,
            METRICS_GROUP,
            CONSUMER_NAME,
            as_type=MetricsEvent,
            cfg=self.cfg.bus,
        )
        log.info(
            "replayed %d metrics events (%d undecodable skipped) from %s",
            applied,
            bad,
            self.keys.metrics,
        )
        return applied

    def save_snapshot(self, *, trim: bool = True) -> str:
        """Save the state; trim the stream up to the previous snapshot (one interval behind)."""
        last = save(self.client, self.keys.metrics_snapshot, self.state)
        if trim and self._trim_to is not None:
            ms, seq = parse_id(self._trim_to)  # MINID keeps its own id: cut just past it
            # never past what the tracker (`streamer track`) has still to write, within its max lag
            ms, seq = hold_back(
                self.client, self.keys.metrics, (ms, seq + 1), TRACKING_GROUP, self.cfg.tracking.max_lag
            )
            cut = f"{ms}-{seq}"
            self.trimmed += int(self.client.xtrim(self.keys.metrics, minid=cut, approximate=False))
        self._trim_to = last
        self.snapshots += 1
        return last

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
        every = self.cfg.metrics.snapshot_interval
        next_snapshot = time.monotonic() + every
        read_at = -READ_GAP
        while not stop.is_set():
            try:
                if self.consumer is None:
                    self.bootstrap()
                if every and time.monotonic() >= next_snapshot:
                    self.save_snapshot()
                    next_snapshot = time.monotonic() + every
                if time.monotonic() >= next_health:
                    self.sample_health()
                    next_health = time.monotonic() + interval
                if (gap := read_at + READ_GAP - time.monotonic()) > 0 and stop.wait(gap):
                    break
                read_at = time.monotonic()
                block = min(max(next_health - read_at, 0.05), self.cfg.bus.block_seconds, 1.0)
                self.consume(block)
                self.alive_at, backoff = time.monotonic(), 0.1
            except TRANSIENT as e:  # first: CLUSTERDOWN is a ResponseError too
                log.warning("server unavailable (%s); retrying in %.1fs", e, backoff)
                self.health_ok = False
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except redis.exceptions.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("metrics stream or group vanished (run reset?): replaying from scratch")
                self.consumer = None

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
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {e.strerror}; set metrics.port or --port"
            ) from None
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, name="metrics-http", daemon=True).start()
        bound = self.http.server_address[1]
        log.info("serving http://%s:%d/metrics for run %s", host, bound, self.keys.run)
        return bound

    def close(self) -> None:
        if self.consumer is not None and self.cfg.metrics.snapshot_interval:
            try:  # the next start replays less
                self.save_snapshot(trim=False)
            except (*TRANSIENT, redis.exceptions.ResponseError) as e:
                log.warning("could not save the metrics state at exit: %s", e)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.client.close()


class _HTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6  # metrics.host = "::" or another IPv6 address


def _handler(ex: Exporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
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

    previous = lifecycle.on_stop_signals(stop, "exporter")
    exporter = Exporter(cfg)
    try:
        exporter.bootstrap()
        exporter.serve()
        exporter.run(stop)
    finally:
        exporter.close()
        lifecycle.restore_signals(previous)
    return 0
