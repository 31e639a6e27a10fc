"""`streamer track`: the run's metrics in TensorBoard or Weights & Biases (``tracking.backend``).

One more consumer of the ``metrics`` stream, with a consumer group of its own
(``tracking``), so it takes nothing from the exporter. Each event is written on its own
axis — train step, rollout step, eval version (per eval set) — by the backend:
:mod:`consumers.tracking_tb` (event files, one TensorBoard run per axis) or
:mod:`consumers.tracking_wandb` (one W&B run, a step key per axis). Every
``tracking.samples_every`` policy versions it adds a table of sampled completions, read
from the rollout archive (:mod:`consumers.sample_tables`).

Exactly once, whatever kills it. An entry is acknowledged only once the backend has it on
disk (``Backend.commit``: TensorBoard fsyncs its files and records their lengths; W&B's
transaction log is read back). On a start the backend says which entry it wrote last,
from its own files; the entries pending in the group up to that one are acknowledged
without being written again, and an entry that is a copy of one already written (an XADD
retried after a lost reply) is skipped. So a point is never written twice, and never
dropped while the stream still holds its entry.

The backend package is imported only by this role, and only the one configured: the extra
``streamer-rl[tracking]`` installs both. Runs until SIGTERM/SIGINT, then writes what has
arrived (the last table too) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import Protocol

from consumers.archive import archive_dir
from consumers.sample_tables import SampleTables
from schemas import DecodeError, MetricsEvent, decode
from streamer import lifecycle
from streamer.bus import FIELD, Consumer, parse_id
from streamer.config import RunConfig
from streamer.connection import connect, retrying
from streamer.errors import ConfigError
from streamer.keys import TRACKING_GROUP, Keys
from streamer.readmodel.saved import SeenIds
from streamer.rundir import FileLock

log = logging.getLogger(__name__)

CONSUMER_NAME = "tracker"  # stable, so a restarted tracker reads its own pending entries first
GATHER_SECONDS = 0.5  # after a read of less than a full batch: one commit (fsync) per gathering
STOP_SERVER_WAIT = 10.0  # seconds a stopping tracker waits for an unreachable server
RETRY_SECONDS = 30.0  # between tries to write again after a disk error
LOCK = ".tracker.lock"


class Backend(Protocol):
    name: str
    written_through: str  # at open: the last metrics entry in the backend's files ("0-0": none)
    tables_through: int  # at open: the version of the last sample table (-1: none)

    def write(self, entry_id: str, event: MetricsEvent) -> None: ...

    def table(self, version: int, rows: list[tuple]) -> None: ...

    def commit(self) -> str: ...  # the entry id through which writes are on disk

    def close(self) -> str: ...

    def discard(self) -> None: ...  # let go of its files after an error, committing nothing


def open_backend(cfg: RunConfig, directory: Path) -> Backend:
    """The configured backend (its package imported now); ConfigError when none is."""
    if cfg.tracking.backend == "tensorboard":
        from consumers.tracking_tb import TensorBoard

        return TensorBoard(directory)
    if cfg.tracking.backend == "wandb":
        from consumers.tracking_wandb import WandB

        return WandB(cfg, directory)
    raise ConfigError('`tracking.backend` is empty: set it to "tensorboard" or "wandb" to track the run')


class Tracker:
    def __init__(self, cfg: RunConfig, *, client=None):
        self.cfg, self.keys = cfg, Keys(cfg.run.name)
        self.dir = cfg.tracking_dir
        if not cfg.tracking.backend:  # before anything is created
            open_backend(cfg, self.dir)
        self.lock = FileLock(self.dir / LOCK, f"tracking dir {self.dir}").acquire()
        try:
            self.client = client or connect(
                cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="streamer-track"
            )
            self.backend = open_backend(cfg, self.dir)
        except BaseException:
            self.lock.release()
            raise
        self.written = self.backend.written_through  # the last entry written, this start or before
        self.seen = self._recent_events(self.written)
        self.consumer = Consumer(
            self.client,
            self.keys,
            self.keys.metrics,
            TRACKING_GROUP,
            CONSUMER_NAME,
            as_type=MetricsEvent,
            cfg=cfg.bus,
        )
        if cfg.tracking.samples_every and not cfg.archive.enabled:
            log.warning(
                "no sample tables: they are read from the rollout archive, and archive.enabled is false"
            )
        self.tables = self._sample_tables()
        # (entry id, its event if written now; None: written before, or a copy), in stream order
        self.unacked: list[tuple[str, MetricsEvent | None]] = []
        self.points = self.skipped = self.tables_written = 0
        self.broken = False  # a disk error, not yet recovered from: nothing more is committed
        log.info(
            "tracking run %s with %s in %s (written through entry %s)",
            self.keys.run,
            self.backend.name,
            self.dir,
            self.written,
        )

    def _sample_tables(self) -> SampleTables | None:
        t = self.cfg.tracking
        if not t.samples_every:
            return None
        return SampleTables(
            archive_dir(self.cfg),
            every=t.samples_every,
            per_table=t.samples_per_table,
            done_through=self.backend.tables_through,
        )

    def _recent_events(self, through: str) -> SeenIds:
        """The event ids of the entries up to ``through``: a copy of one of them after it is
        an XADD retried after its reply was lost, written once already."""
        seen = SeenIds()
        if through == "0-0":
            return seen
        rows = self.client.xrevrange(self.keys.metrics, max=through, count=seen.order.maxlen)
        for _, fields in reversed(rows):
            try:
                seen.add(decode(fields.get(FIELD, b""), MetricsEvent).id)
            except DecodeError:  # dead-lettered by the group's reader: nothing written to remember
                continue
        return seen

    def step(self, block: float | None = None) -> int:
        """Read one batch, write what is new, commit, acknowledge what is on disk. Entries read."""
        got = self.consumer.read(block=block)
        for d in got:
            new = parse_id(d.id) > parse_id(self.written) and self.seen.add(d.event.id)
            if new:
                self.backend.write(d.id, d.event)
                self.written = d.id
                self.points += len(d.event.values)
            else:
                self.skipped += 1
            self.unacked.append((d.id, d.event if new else None))
        if self.tables is not None:
            self._tables(self.tables.read())
        self._acknowledge(self.backend.commit())
        return len(got)

    def _tables(self, tables: list[tuple[int, list[tuple]]]) -> None:
        for version, rows in tables:
            if version > self.backend.tables_through:
                self.backend.table(version, rows)
                self.tables_written += 1

    def _acknowledge(self, durable: str) -> None:
        """Acknowledge the entries in order up to the first written one not yet on disk."""
        n = 0
        for entry_id, event in self.unacked:
            if event is not None and parse_id(entry_id) > parse_id(durable):
                break
            n += 1
        if n:
            self.consumer.ack(entry_id for entry_id, _ in self.unacked[:n])
            del self.unacked[:n]

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                read = retrying(lambda: self.step(block=1.0), what="tracking metrics")
            except OSError as e:  # a full or unwritable disk: training goes on, so do we
                self._recover(e, stop)
                continue
            if read < self.cfg.bus.read_count:
                stop.wait(GATHER_SECONDS)
        if not self.broken:  # stopping (after the trainer and the archiver): what arrived since
            retrying(self._drain, what="tracking the last metrics", give_up_after=STOP_SERVER_WAIT)

    def _recover(self, error: OSError, stop: threading.Event) -> None:
        """Start the backend over from its last commit, as a restart would, and write again
        what it lost (the entries it has not acknowledged are still in ``unacked``)."""
        log.error(
            "cannot write the %s files in %s (%s): retrying in %.0fs from the last commit; "
            "the metrics wait in the stream (up to tracking.max_lag entries)",
            self.backend.name,
            self.dir,
            getattr(error, "strerror", None) or error,
            RETRY_SECONDS,
        )
        self.broken = True
        self.backend.discard()
        while not stop.wait(RETRY_SECONDS):
            try:
                self.backend = open_backend(self.cfg, self.dir)
                self.written = self.backend.written_through
                for entry_id, event in self.unacked:
                    if event is not None and parse_id(entry_id) > parse_id(self.written):
                        self.backend.write(entry_id, event)
                        self.written = entry_id
                self.tables = self._sample_tables()
                self.broken = False
                return
            except OSError as e:
                log.warning("still cannot write the %s files: %s", self.backend.name, e)
                self.backend.discard()

    def _drain(self) -> None:
        while self.step(block=0):
            pass

    def close(self) -> None:
        """Write the table being filled, close the backend, acknowledge what it holds (after a
        disk error not recovered from: nothing; the next start takes over from the last commit)."""
        try:
            if not self.broken:
                if self.tables is not None:
                    self._tables(self.tables.flush())
                durable = self.backend.close()
                retrying(
                    lambda: self._acknowledge(durable), what="acknowledging", give_up_after=STOP_SERVER_WAIT
                )
        finally:
            self.lock.release()
            log.info(
                "tracked %d points and %d tables; %d entries skipped (written before)",
                self.points,
                self.tables_written,
                self.skipped,
            )


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Track until SIGTERM/SIGINT (exit 0)."""
    return lifecycle.run_role("tracker", lambda: Tracker(cfg))
