"""Tables of sampled completions for the tracker, read from the rollout archive.

The table of policy version ``v`` (every ``tracking.samples_every``-th version, 0 first)
holds the first ``tracking.samples_per_table`` completions that ``v`` sampled, in archive
order: prompt, completion, reward, version. It is complete once it is full, or once the
archive shows a group of a later version (producers have moved on; the table keeps what
there was, and a version that sampled nothing gets none).

The archive is read as it grows (:class:`ArchiveTail`): the gzip files the archiver
appends to with sync flushes, followed in order, through rotation and pruning. Nothing of
its position is saved: a restarted tracker knows the last version it wrote a table for,
and starts at the newest file whose first group is not past the next one due.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from pathlib import Path

from consumers.archive import PATTERN

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "completion", "reward", "version")
MAX_CELL = 10_000  # characters of a prompt or completion kept in a table cell
READ_BYTES = 1 << 20

Row = tuple[str, str, float, int]


class ArchiveTail:
    """The complete JSON lines appended to the archive's files, oldest file first."""

    def __init__(self, directory: Path, start: Path | None = None):
        self.dir = Path(directory)
        self.path = start
        self._file = None
        self._inflate = zlib.decompressobj(31)
        self._partial = b""
        self._broken = False  # the current file stopped decoding: read on from the next one

    def records(self) -> list[dict]:
        """Every record written since the last call (none while the archive has no file)."""
        out: list[dict] = []
        while True:
            missing = self.path is None or (self._file is None and not self.path.exists())
            if missing and not self._advance():
                return out
            newer = self._newer()  # looked at first: once it exists, this file grows no more
            out += self._read()
            if not newer:
                return out
            self._close()
            self.path = newer[0]

    def _advance(self) -> bool:
        files = sorted(self.dir.glob(PATTERN)) if self.dir.is_dir() else []
        later = [f for f in files if self.path is None or f.name > self.path.name]
        if not later:
            return False
        if self.path is not None:
            log.warning("archive file %s is gone (pruned): reading on at %s", self.path.name, later[0].name)
        self._close()
        self.path = later[0]
        return True

    def _newer(self) -> list[Path]:
        return sorted(f for f in self.dir.glob(PATTERN) if f.name > self.path.name)

    def _read(self) -> list[dict]:
        if self._broken:
            return []
        data = bytearray()
        try:
            if self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open between reads
            while chunk := self._file.read(READ_BYTES):
                self._inflate_into(data, chunk)
        except (OSError, zlib.error) as e:  # the lines decoded before it still count
            log.warning("cannot read archive file %s (%s): skipping the rest of it", self.path.name, e)
            self._broken = True
        lines = (self._partial + bytes(data)).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("archive file %s has a line that is not JSON: skipped", self.path.name)
        return out

    def _inflate_into(self, data: bytearray, chunk: bytes) -> None:
        """Decompress across gzip members (a restarted archiver appends a new one); what
        decodes before an error is kept."""
        data += self._inflate.decompress(chunk)
        while self._inflate.eof and (rest := self._inflate.unused_data):
            self._inflate = zlib.decompressobj(31)
            data += self._inflate.decompress(rest)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._partial, self._broken = None, b"", False
        self._inflate = zlib.decompressobj(31)


def first_version(path: Path) -> int | None:
    """The policy version of the first group in an archive file (None: unreadable or empty)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return int(json.loads(f.readline())["policy_version"])
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError):
        return None


def start_file(directory: Path, version: int) -> Path | None:
    """The newest archive file whose first group is not past ``version`` (else the oldest)."""
    files = sorted(Path(directory).glob(PATTERN)) if Path(directory).is_dir() else []
    for f in reversed(files):
        first = first_version(f)
        if first is not None and first <= version:
            return f
    return files[0] if files else None


class SampleTables:
    """Turns archive records into the tables due: version -> rows."""

    def __init__(self, directory: Path, *, every: int, per_table: int, done_through: int):
        self.every, self.per_table = every, per_table
        self.due = (done_through // every + 1) * every if done_through >= 0 else 0
        self.rows: list[Row] = []
        self.tail = ArchiveTail(directory, start_file(directory, self.due))

    def read(self) -> list[tuple[int, list[Row]]]:
        """The tables completed by what the archive gained since the last call."""
        out = []
        for rec in self.tail.records():
            out += self._take(rec)
        return out

    def flush(self) -> list[tuple[int, list[Row]]]:
        """The table being filled, as it is (the tracker stops)."""
        return self._complete() if self.rows else []

    def _take(self, rec: dict) -> list[tuple[int, list[Row]]]:
        out = []
        try:
            version = int(rec["policy_version"])
            completions = rec["completions"]
        except (KeyError, TypeError, ValueError):
            return out
        if version > self.due:  # the producers have moved past the version due
            out += self._complete() if self.rows else []
            self.due = max(self.due, -(-version // self.every) * self.every)
        if version != self.due:
            return out
        for c in completions:
            if len(self.rows) < self.per_table and c.get("version", version) == version:
                prompt = c.get("prompt", rec.get("prompt", ""))
                self.rows.append((_cell(prompt), _cell(c.get("text", "")), float(c["reward"]), version))
        if len(self.rows) >= self.per_table:
            out += self._complete()
        return out

    def _complete(self) -> list[tuple[int, list[Row]]]:
        done = (self.due, self.rows)
        self.rows = []
        self.due += self.every
        return [done]


def _cell(text: str) -> str:
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"
