"""The tracker's Weights & Biases backend: one W&B run per Streamer run, resumed, exactly once.

Keys and axes. Each metrics event is one history row: ``train/<name>`` with ``train/step``,
``rollout/<name>`` with ``rollout/step``, ``eval/<set>/<name>`` with ``eval/version``, and
sample tables as ``samples/rollouts`` (a ``wandb.Table``) with ``samples/version``.
``define_metric`` makes each group's charts use its own step key, so the axes stay apart.
W&B's own ``_step`` just counts rows; it continues across restarts.

Resume. The run id is ``tracking.id``, else one made on the first start and kept in
``streamer-wandb.json`` in the tracking dir; every start calls ``wandb.init(id=...,
resume="allow")``. Online, W&B continues the run on its server; offline, each start is a
directory of its own under ``{tracking.dir}/wandb/`` (``offline-run-*-{id}``), and ``wandb
sync`` uploads them, in order, into the one run.

Exactly once. Every row carries the metrics entry it came from in a hidden key,
``_streamer_entry``. wandb writes rows to the run's transaction log (the ``.wandb`` file)
in order, in the background (every ``FLUSH_SECONDS`` here); :class:`TransactionLog` reads
that file as it grows, and the tracker acknowledges an entry only once its row is there.
On a start, the rows in the transaction logs of this run id (every earlier directory, and
online the run's summary) say which entry was written last: pending entries up to it are
acknowledged without being logged again. Rows logged but not yet in the file when the
tracker died went with it (wandb's service does not outlive it), and are logged again.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import time
import zlib
from pathlib import Path

import msgspec

from consumers.sample_tables import COLUMNS
from schemas import MetricsEvent
from schemas.metric_names import DEFAULT_EVAL_SET
from streamer.bus import parse_id
from streamer.config import RunConfig
from streamer.connection import redact
from streamer.disk import replace_durably
from streamer.errors import ConfigError, StreamerError

log = logging.getLogger(__name__)

STATE = "streamer-wandb.json"
ENTRY_KEY = "_streamer_entry"  # underscore: W&B keeps it out of the charts
STEP_KEYS = {
    "train": "train/step",
    "rollout": "rollout/step",
    "eval": "eval/version",
    "samples": "samples/version",
}
TABLE_KEY = "samples/rollouts"
FLUSH_SECONDS = 1.0  # how often wandb writes the transaction log (its default is 15 s)
CLOSE_WAIT = 30.0  # seconds a stopping tracker waits for wandb to write out what was logged


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "tracking.backend = \"wandb\" needs the wandb package: pip install 'streamer-rl[tracking]'"
        ) from None
    return wandb


class WandB:
    name = "wandb"

    def __init__(self, cfg: RunConfig, directory: Path):
        wandb = _wandb()
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        run_id = cfg.tracking.id or self._saved_id(cfg)
        past = [row for path in logs_of(self.dir, run_id) for row in history(path)]
        self.written_through = max(
            (r[ENTRY_KEY] for r in past if ENTRY_KEY in r), key=parse_id, default="0-0"
        )
        self.tables_through = max((int(r[STEP_KEYS["samples"]]) for r in past if _is_table(r)), default=-1)
        self.next_step = max((int(r["_step"]) + 1 for r in past if "_step" in r), default=0)
        # wandb's service process: our own, never one inherited from a parent process that uses
        # wandb. One that outlived a killed tracker could write rows it held after the restart
        # has logged them again.
        os.environ.pop("WANDB_SERVICE", None)
        settings = {"console": "off", "silent": True}
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:
            settings["x_transaction_log_flush_interval"] = FLUSH_SECONDS
        try:
            self.run = wandb.init(
                project=cfg.tracking.project,
                entity=cfg.tracking.entity or None,
                name=cfg.tracking.name or cfg.run.name,
                id=run_id,
                resume="allow",
                dir=str(self.dir),
                mode=cfg.tracking.mode or None,
                config=_config(cfg),
                settings=wandb.Settings(**settings),
            )
        except Exception as e:  # wandb's errors have no common base; each is one line here
            raise StreamerError(
                f"W&B could not start run {run_id}: {e} (log in with `wandb login`, or set "
                'tracking.mode = "offline")'
            ) from None
        self._resumed_online(self.run)
        for axis, step_key in STEP_KEYS.items():
            self.run.define_metric(step_key)
            self.run.define_metric(f"{axis}/*", step_metric=step_key)
        self.log = TransactionLog(Path(self.run.settings.sync_file))
        self.durable = self.written_through  # the last entry whose row is in the transaction log
        self.durable_step = self.next_step - 1  # the last row (any row) in it
        self._warned: set[str] = set()
        self.finished = False
        log.info("W&B run %s (%s) in %s", run_id, self.run.settings.mode, self.run.settings.sync_dir)

    def _saved_id(self, cfg: RunConfig) -> str:
        path = self.dir / STATE
        try:
            return str(json.loads(path.read_text())["id"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{path} is unreadable ({e}): set tracking.id, or move the file aside"
            ) from None
        run_id = f"{cfg.run.name}-{secrets.token_hex(4)}"
        replace_durably(path, json.dumps({"id": run_id}).encode())
        return run_id

    def _resumed_online(self, run) -> None:
        """An online run resumed on another machine: what its server has (the summary holds
        each key's last value, and rows are logged in entry order)."""
        last = run.summary.get(ENTRY_KEY)
        if isinstance(last, str) and parse_id(last) > parse_id(self.written_through):
            self.written_through = last
        self.next_step = max(self.next_step, int(run.step or 0))

    # ------------------------------------------------------------ writing

    def write(self, entry_id: str, event: MetricsEvent) -> None:
        step_key = STEP_KEYS[event.axis]
        prefix = f"eval/{event.eval_set or DEFAULT_EVAL_SET}" if event.axis == "eval" else event.axis
        row: dict = {step_key: event.step, ENTRY_KEY: entry_id}
        for name, value in event.values.items():
            key = f"{prefix}/{name}"
            if key == step_key:
                self._warn(key, f"a {event.axis} metric named {name!r} would overwrite {step_key}: left out")
                continue
            row[key] = value
        self._log(row)

    def table(self, version: int, rows: list[tuple]) -> None:
        wandb = _wandb()
        table = wandb.Table(columns=list(COLUMNS), data=[list(r) for r in rows])
        self._log({STEP_KEYS["samples"]: version, TABLE_KEY: table})
        self.tables_through = version

    def _log(self, row: dict) -> None:
        self.run.log(row, step=self.next_step, commit=True)
        self.next_step += 1

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # ------------------------------------------------------------ committing

    def commit(self) -> str:
        """The entry id through which rows are in the transaction log (wandb writes it itself)."""
        for row in self.log.rows():
            if ENTRY_KEY in row and parse_id(row[ENTRY_KEY]) > parse_id(self.durable):
                self.durable = row[ENTRY_KEY]
            self.durable_step = max(self.durable_step, int(row.get("_step", -1)))
        return self.durable

    def discard(self) -> None:
        """Finish the run after an error; what it wrote is read back on the next start."""
        if not self.finished:
            self.finished = True
            try:
                self.run.finish(exit_code=1)
            except Exception as e:  # wandb's errors have no common base
                log.warning("W&B run did not finish cleanly: %s", e)

    def close(self) -> str:
        """Finish the run, and wait until every row logged is in the transaction log: finish()
        may return before wandb's service has written it, and the service does not outlive us."""
        if self.finished:
            return self.commit()
        self.finished = True
        self.run.finish()
        deadline = time.monotonic() + CLOSE_WAIT
        while self.commit() and self.durable_step < self.next_step - 1:
            if time.monotonic() > deadline:
                log.warning(
                    "W&B wrote rows through %d of %d within %.0fs; the rest are logged again next start",
                    self.durable_step,
                    self.next_step - 1,
                    CLOSE_WAIT,
                )
                break
            time.sleep(0.05)
        return self.durable


def _is_table(row: dict) -> bool:
    return STEP_KEYS["samples"] in row and any(k.startswith(TABLE_KEY) for k in row)


def _config(cfg: RunConfig) -> dict:
    """The run's config for W&B, with the password of every URL in it replaced."""

    def clean(v):
        if isinstance(v, dict):
            return {
                k: redact(x) if k.endswith("url") and isinstance(x, str) else clean(x) for k, x in v.items()
            }
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean(msgspec.to_builtins(cfg))


def logs_of(directory: Path, run_id: str) -> list[Path]:
    """The transaction logs of every earlier start of run ``run_id`` under ``directory``."""
    return sorted(Path(directory).glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))


def history(path: Path) -> list[dict]:
    """The history rows of a whole transaction log, as {key: value}."""
    return TransactionLog(path).rows()


# ---------------------------------------------------------------- the transaction log

HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
CHUNK = struct.Struct("<IHB")  # crc32 of type + data, length, type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class TransactionLog:
    """Reads a ``.wandb`` file as wandb writes it: LevelDB's log format (32 KiB blocks of
    checksummed chunks), each record a ``wandb_internal_pb2.Record``. Only complete, intact
    records are returned; a torn end is waited for, never skipped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pos = 0
        self.parts: list[bytes] = []
        self.broken = False

    def records(self) -> list[bytes]:
        """The records completed since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        base, at, out = self.pos, 0, []
        if base == 0:
            if len(data) < HEADER.size:
                return []
            ident, _magic, _version = HEADER.unpack_from(data)
            if ident != b":W&B":
                self._break("is not a W&B transaction log")
                return []
            at = HEADER.size
        while not self.broken:
            left = BLOCK - (base + at) % BLOCK
            if left < CHUNK.size:  # a block's tail too short for a chunk is padding
                if len(data) - at < left:
                    break
                at += left
                continue
            if len(data) - at < CHUNK.size:
                break
            crc, length, kind = CHUNK.unpack_from(data, at)
            if kind == 0 and length == 0:  # preallocated zeros: the rest of the block is empty
                if len(data) - at < left:
                    break
                at += left
                continue
            end = at + CHUNK.size + length
            if end > len(data):
                break  # still being written
            chunk = data[at + CHUNK.size : end]
            if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc or kind not in (FULL, FIRST, MIDDLE, LAST):
                self._break(f"has a damaged record at byte {base + at}; reading stops there")
                break
            at = end
            if kind == FULL:
                out.append(chunk)
            elif kind == FIRST:
                self.parts = [chunk]
            elif kind == MIDDLE:
                self.parts.append(chunk)
            else:
                out.append(b"".join([*self.parts, chunk]))
                self.parts = []
        self.pos = base + at
        return out

    def rows(self) -> list[dict]:
        """The history rows among the records completed since the last call."""
        from wandb.proto import wandb_internal_pb2 as pb

        out = []
        for raw in self.records():
            record = pb.Record.FromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items})
        return out

    def _break(self, why: str) -> None:
        self.broken = True
        log.warning("%s %s", self.path, why)
