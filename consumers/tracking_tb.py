"""The tracker's TensorBoard backend: event files written exactly once, across crashes.

Layout under ``tracking.dir`` (``tensorboard --logdir`` it), one TensorBoard run per axis::

    train/         train/<name>    at the trainer step
    rollout/       rollout/<name>  at the rollout step
    eval/<set>/    eval/<name>     at the policy version, one run per eval set
    samples/       samples/rollouts, a text table at the policy version

Runs keep the axes apart in the run selector, and tags carry the axis, so two axes' metrics
of one name (``rollout/reward_mean``, ``eval/reward_mean``) never share a chart whose x
axis would mix steps and versions; eval sets, each a run, overlay on one chart per metric.

Exactly once. Each run directory has one event file of ours (``events.out.tfevents.*.streamer``),
appended to across restarts; records are TFRecord-framed ``Event`` protos, the format
TensorBoard reads. :meth:`TensorBoard.commit` flushes and fsyncs the files written, then
replaces ``streamer-tensorboard.json`` (the last metrics entry written, the last table's
version, each file's length) durably; only then does the tracker acknowledge the entries.
A tracker killed after writing and before committing leaves bytes past those lengths: the
next start cuts every file back to its committed length, and the entries after the commit,
still pending in the consumer group, are written again, once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

from consumers.sample_tables import COLUMNS
from schemas import MetricsEvent
from schemas.metric_names import DEFAULT_EVAL_SET
from streamer.disk import replace_durably
from streamer.errors import ConfigError

log = logging.getLogger(__name__)

STATE = "streamer-tensorboard.json"
SUFFIX = ".streamer"  # our event files' names end so; a file of that name and no commit is ours to remove
TABLE_TAG = "samples/rollouts"


def _tensorboard() -> SimpleNamespace:
    """What is used of the tensorboard package (imported here: only this backend needs it)."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        raise ConfigError(
            'tracking.backend = "tensorboard" needs the tensorboard package: '
            "pip install 'streamer-rl[tracking]'"
        ) from None
    return SimpleNamespace(
        Event=event_pb2.Event,
        Summary=summary_pb2.Summary,
        TensorProto=tensor_pb2.TensorProto,
        Shape=tensor_shape_pb2.TensorShapeProto,
        DT_STRING=types_pb2.DT_STRING,
        text_metadata=text_metadata.create_summary_metadata,
        RecordWriter=RecordWriter,
    )


def run_of(event: MetricsEvent) -> str:
    """The TensorBoard run (a directory under tracking.dir) of an event."""
    if event.axis == "eval":
        return f"eval/{safe_name(event.eval_set or DEFAULT_EVAL_SET)}"
    return event.axis


def safe_name(name: str) -> str:
    """An eval set's name as one directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


class _EventFile:
    def __init__(self, path: Path, tb: SimpleNamespace):
        new = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = open(path, "ab")  # noqa: SIM115 - open for the tracker's life
        self.records = tb.RecordWriter(self.fh)
        if new:  # every event file starts with its format version
            first = tb.Event(wall_time=time.time(), file_version="brain.Event:2")
            self.records.write(first.SerializeToString())

    def sync(self) -> int:
        """Flush and fsync; the file's length."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        return self.fh.tell()


class TensorBoard:
    name = "tensorboard"

    def __init__(self, directory: Path):
        self.tb = _tensorboard()
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        state = self._load()
        self.written_through: str = state.get("last_id", "0-0")
        self.committed = self.written_through
        self.tables_through: int = int(state.get("tables_through", -1))
        self.lengths: dict[str, int] = dict(state.get("files", {}))  # file (relative) -> committed length
        self._cut_back()
        self.files: dict[str, _EventFile] = {}  # run -> its event file
        self.dirty: set[str] = set()

    # ------------------------------------------------------------ writing

    def write(self, entry_id: str, event: MetricsEvent) -> None:
        tb = self.tb
        values = [
            tb.Summary.Value(tag=f"{event.axis}/{name}", simple_value=float(v))
            for name, v in sorted(event.values.items())
        ]
        ev = tb.Event(wall_time=event.at, step=event.step, summary=tb.Summary(value=values))
        self._append(run_of(event), ev)
        self.written_through = entry_id

    def table(self, version: int, rows: list[tuple]) -> None:
        """A text summary: a 2-D string tensor, the header first, which TensorBoard shows as a table."""
        tb = self.tb
        table = [COLUMNS, *rows]
        tensor = tb.TensorProto(
            dtype=tb.DT_STRING,
            tensor_shape=tb.Shape(dim=[tb.Shape.Dim(size=len(table)), tb.Shape.Dim(size=len(COLUMNS))]),
            string_val=[str(cell).encode() for row in table for cell in row],
        )
        meta = tb.text_metadata(display_name="", description="")
        value = tb.Summary.Value(tag=TABLE_TAG, metadata=meta, tensor=tensor)
        ev = tb.Event(wall_time=time.time(), step=version, summary=tb.Summary(value=[value]))
        self._append("samples", ev)
        self.tables_through = version

    def _append(self, run: str, ev) -> None:
        f = self.files.get(run)
        if f is None:
            f = self.files[run] = _EventFile(self._file_path(run), self.tb)
        f.records.write(ev.SerializeToString())
        self.dirty.add(run)

    def _file_path(self, run: str) -> Path:
        """The run's event file of ours: the committed one, else a new name."""
        for rel in self.lengths:
            if Path(rel).parent == Path(run):
                return self.dir / rel
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
        return self.dir / run / f"events.out.tfevents.{int(time.time())}.{host}{SUFFIX}"

    # ------------------------------------------------------------ committing

    def commit(self) -> str:
        """Make what was written durable and record it; the entry id it covers."""
        if not self.dirty:
            return self.committed
        for run in sorted(self.dirty):
            f = self.files[run]
            self.lengths[str(f.path.relative_to(self.dir))] = f.sync()
        state = {
            "last_id": self.written_through,
            "tables_through": self.tables_through,
            "files": self.lengths,
        }
        replace_durably(self.dir / STATE, json.dumps(state, indent=1).encode())
        self.dirty.clear()
        self.committed = self.written_through
        return self.committed

    def close(self) -> str:
        try:
            return self.commit()
        finally:
            self.discard()

    def discard(self) -> None:
        """Close the files; what was written since the last commit is cut on the next start."""
        for f in self.files.values():
            try:
                f.fh.close()
            except OSError:
                pass
        self.files.clear()
        self.dirty.clear()

    # ------------------------------------------------------------ restart

    def _load(self) -> dict:
        path = self.dir / STATE
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{path} is unreadable ({e}): move the tracking dir aside to start it over"
            ) from None
        if not isinstance(state, dict):
            raise ConfigError(f"{path} is not a tracker state: move the tracking dir aside to start it over")
        return state

    def _cut_back(self) -> None:
        """Cut our event files back to their committed lengths; remove ours never committed."""
        for path in self.dir.rglob(f"events.out.tfevents.*{SUFFIX}"):
            rel = str(path.relative_to(self.dir))
            committed = self.lengths.get(rel)
            size = path.stat().st_size
            if committed is None:
                log.info("removing %s: written after the last commit", rel)
                path.unlink()
            elif size > committed:
                log.info(
                    "cutting %s back to %d bytes: %d written after the last commit",
                    rel,
                    committed,
                    size - committed,
                )
                with open(path, "r+b") as f:
                    f.truncate(committed)
            elif size < committed:
                log.warning(
                    "%s is shorter (%d bytes) than committed (%d): points were lost", rel, size, committed
                )
                self.lengths[rel] = size
