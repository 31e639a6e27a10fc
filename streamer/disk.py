"""Writing to disk: one clear error for a failed write, and directories that appear whole.

:func:`atomic_dir` is how a policy version and a checkpoint reach their final names: built
in a temporary directory, renamed into place, so a reader never sees half of one. Only a
checkpoint is the durable state, so only a checkpoint pays for ``fsync`` (``durable=True``):
a version lost in a machine crash is published again under a new number after the trainer
restores, and its readers check its bytes (:func:`streamer.weights.resolve`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from streamer.errors import DiskError


@contextlib.contextmanager
def writing(what: str, directory: Path):
    """Turn a failed write (disk full, read-only, no permission) into one clear DiskError."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise DiskError(f"cannot write {what} in {directory}: {reason}") from e


@contextlib.contextmanager
def atomic_dir(root: Path, name: str, *, what: str, durable: bool = True):
    """A temporary directory under ``root`` that becomes ``root/name`` once the block ends,
    a leftover of that name replaced (names are never reused, so one can only be a crash's).
    ``durable``: every file in it fsynced before the rename, and the rename fsynced, so the
    directory survives a machine crash whole; without it the rename alone keeps readers from
    seeing half of it while the machine runs. On an error nothing appears under ``name`` and
    the temporary directory is removed; a failed write is a DiskError."""
    root = Path(root)
    with writing(what, root):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            yield tmp
            if durable:
                for f in tmp.rglob("*"):
                    fsync(f)
                fsync(tmp)
            if (root / name).exists():
                shutil.rmtree(root / name)
            os.rename(tmp, root / name)
            if durable:
                fsync(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def numbered(root: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(number, path) of each directory under ``root`` whose name ``pattern`` matches, the
    number being its last group; ascending ([] without ``root``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = ((m, p) for p in root.iterdir() if p.is_dir() and (m := pattern.match(p.name)))
    return sorted((int(m.group(m.lastindex)), p) for m, p in found)


def remove_unfinished(root: Path) -> None:
    """Remove what :func:`atomic_dir` left under ``root`` when its process died mid-write."""
    for tmp in Path(root).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def fsync(path: Path) -> None:
    """fsync a file or directory, best effort (some filesystems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` whole or not at all, surviving a machine crash: written to a
    temporary file beside it, fsynced, renamed over it, the rename fsynced. OSError on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)
