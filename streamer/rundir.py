"""What Streamer owns on disk, and who may use it at once.

- **Names.** A run name is a plain file name (see :mod:`streamer.keys`): never ``.``,
  ``..``, a path, or hidden, so ``{data_dir}/{run}`` is always a child of the data dir.
- **Markers.** Every directory Streamer creates for a run, and the embedded server's data
  directory, holds a marker file. ``--fresh`` deletes only marked directories, and inside
  them only the entries Streamer writes; anything else is left alone with a clear error.
- **Locks.** ``fcntl.flock`` on a lock file: ``{data_dir}/.server.lock`` while an `up`
  runs the embedded server there, ``{data_dir}/{run}/.trainer.lock`` while a trainer
  trains the run. The kernel drops a lock when its holder dies, so a crash leaves nothing
  to clean up; a second holder gets one line naming the first one's pid.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path

from streamer.disk import writing
from streamer.errors import ConfigError, LockedError

RUN_MARKER = ".streamer-run"  # {data_dir}/{run}/: created by streamer for this run
SERVER_MARKER = ".streamer-server"  # {data_dir}/valkey/: the embedded server's data
SERVER_LOCK = ".server.lock"
TRAINER_LOCK = ".trainer.lock"
TRAINER_ID = ".trainer-id"  # the owner token of the run's trainer lease (streamer.trainer_lease)
# what Streamer writes inside a run directory (anything else is the user's and is kept)
ENGINE_MODEL = "engine-model"  # `up --engine`: the demo model the engine serves
ENGINE_CONFIG = "engine.toml"  # `up --engine`: the run config with the engine's settings
ARCHIVE = "archive"  # `streamer archive`: the run's rollout groups as text
TRACKING = "tracking"  # `streamer track`: TensorBoard / W&B files (tracking.dir unless set)
RUN_ENTRIES = (
    "weights",
    "checkpoints",
    "logs",
    ARCHIVE,
    TRACKING,
    "curve.json",
    ENGINE_MODEL,
    ENGINE_CONFIG,
    TRAINER_LOCK,
    TRAINER_ID,
    RUN_MARKER,
)


def mark(directory: Path, marker: str) -> Path:
    """Create ``directory`` (if needed) and mark it as Streamer's."""
    directory = Path(directory)
    if (directory / marker).is_file():  # nothing to write (the disk may be read-only by now)
        return directory
    with writing(f"the marker of {directory}", directory.parent):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / marker).touch()
    return directory


def mark_run(run_dir: Path) -> Path:
    return mark(run_dir, RUN_MARKER)


def remove_marked(directory: Path, marker: str, entries: tuple[str, ...] | None = None) -> bool:
    """Delete a directory Streamer marked (only ``entries`` of it, if given); False if absent.

    Raises ConfigError for an unmarked directory: it was not created by Streamer.
    """
    directory = Path(directory)
    if not directory.exists():
        return False
    if directory.is_symlink() or not (directory / marker).is_file():
        raise ConfigError(
            f"{directory} has no {marker} marker, so Streamer did not create it; "
            "refusing to delete it (remove it yourself if it should go)"
        )
    if entries is None:
        shutil.rmtree(directory)
        return True
    for name in entries:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    try:
        directory.rmdir()  # only if nothing of the user's is left
    except OSError:
        pass
    return True


class FileLock:
    """An exclusive, non-blocking ``flock`` held until :meth:`release` or process exit."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def acquire(self) -> FileLock:
        if not self.path.exists():
            self._create()
        # held read-only: flock needs no write access, and a disk with a file open for writing
        # cannot be remounted read-only
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LockedError(f"{self.what} is in use by {holder} (lock {self.path})") from None
        try:  # who holds it, for the next one's message (best effort)
            self.path.write_text(f"pid {os.getpid()}\n")
        except OSError:
            pass
        self._fd = fd
        return self

    def _create(self) -> None:
        with writing(f"lock {self.path.name}", self.path.parent):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def server_lock(data_dir: Path) -> FileLock:
    return FileLock(Path(data_dir) / SERVER_LOCK, f"data dir {data_dir} (its embedded server)")


def trainer_lock(run_dir: Path) -> FileLock:
    return FileLock(Path(run_dir) / TRAINER_LOCK, f"run {Path(run_dir).name} in {Path(run_dir).parent}")


def trainer_id(run_dir: Path) -> str:
    """The token that identifies this run directory's trainer to the server (created once):
    the same trainer restarted finds its lease again, one with another data dir does not."""
    path = Path(run_dir) / TRAINER_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    token = uuid.uuid4().hex
    with writing(f"the trainer id {path}", path.parent):
        tmp = path.with_name(f".{TRAINER_ID}.{os.getpid()}")
        tmp.write_text(token + "\n")
        os.replace(tmp, path)  # the trainer lock is held: nobody else writes it meanwhile
    return token


def check_free(lock: FileLock) -> None:
    """Fail now (one line) if ``lock`` is held elsewhere; does not keep it (nor create it)."""
    if lock.path.exists():  # a holder always has the file; no file, no holder
        lock.acquire().release()
