"""A file's hash list: the BLAKE3 of each consecutive :data:`PIECE` bytes, on several cores.

BLAKE3 is a cryptographic hash at ~8 GB/s a core on the development VM (SHA-256, even with
the CPU's SHA extensions, ~2 GB/s: longer than writing the 390 MB of a ~100M-parameter
version takes), and the pieces of a file are independent: :func:`write` writes and hashes
them on :data:`THREADS` threads, each piece written and then hashed a slice at a time while
the slice is still in cache, and :func:`of_file` re-hashes a file the same way (blake3,
``os.pwrite`` and file reads all release the GIL). A caller's ``check`` runs in the same
pass, on each slice just before it is written (the version writer's inf/NaN check: on every
core, on bytes brought into cache for the write anyway, instead of one more pass on one core
before the write starts). A policy version's manifest lists every file's pieces, and its
announcement carries the sha256 of the manifest (a few kilobytes): a hash list one level
deep, as a BitTorrent metainfo's (streamer/weights.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from blake3 import blake3  # releases the GIL while it hashes

HASH = "blake3"  # the hash of each piece, as a manifest names it
Check = Callable[[int, int, int], None]  # (buffer index, begin, end): raises to stop the write

PIECE = 1 << 24  # bytes a piece (the last one of a file may be shorter)
THREADS = max(1, min(8, len(os.sched_getaffinity(0))))  # hashing threads of one call
_SLICE = 1 << 20  # written, then hashed while still in cache


def write(path: Path, buffers: Sequence, check: Check | None = None) -> tuple[list[str], int]:
    """Write ``buffers`` (bytes-like, in order) as the file ``path``; (the :data:`HASH` hex
    of each piece, bytes written).

    ``check(i, begin, end)``: called on a writing thread with bytes ``begin:end`` of
    ``buffers[i]`` before they are written, every byte once; what it raises stops every
    thread at its next slice and is raised here (the file is then incomplete: the caller
    discards it)."""
    views = [memoryview(b).cast("B") for b in buffers]
    plan, size = _pieces(views), sum(len(v) for v in views)
    stop = threading.Event()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def one(parts: list[tuple[int, memoryview, int, int]]) -> str:
            h = blake3()
            try:
                for offset, view, index, begin in parts:
                    for i in range(0, len(view), _SLICE):
                        if stop.is_set():
                            return ""
                        piece = view[i : i + _SLICE]
                        if check is not None:
                            check(index, begin + i, begin + i + len(piece))
                        _pwrite(fd, piece, offset + i)
                        h.update(piece)
            except BaseException:
                stop.set()
                raise
            return h.hexdigest()

        return on_threads(one, plan), size
    finally:
        os.close(fd)


def of_file(path: Path, piece: int = PIECE) -> list[str]:
    """The :data:`HASH` hex of each ``piece`` bytes of the file at ``path``."""
    size = Path(path).stat().st_size

    def one(start: int) -> str:
        h, buf = blake3(), bytearray(min(_SLICE, piece))
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            left = min(piece, size - start)
            while left > 0 and (n := f.readinto(view[: min(left, len(buf))])):
                h.update(view[:n])
                left -= n
        return h.hexdigest()

    return on_threads(one, range(0, size, piece))


def _pieces(views: list[memoryview]) -> list[list[tuple[int, memoryview, int, int]]]:
    """The buffers cut at every multiple of PIECE of the file: per piece, (file offset, bytes,
    which buffer, where in it)."""
    plan: list[list[tuple[int, memoryview, int, int]]] = []
    offset = 0
    for index, view in enumerate(views):
        i = 0
        while i < len(view):
            if offset % PIECE == 0:
                plan.append([])
            n = min(len(view) - i, PIECE - offset % PIECE)
            plan[-1].append((offset, view[i : i + n], index, i))
            i, offset = i + n, offset + n
    return plan


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def on_threads(fn: Callable, items) -> list:
    """``[fn(x) for x in items]``, on up to :data:`THREADS` threads (for work that releases
    the GIL: hashing, file I/O, tensor copies)."""
    items = list(items)
    if len(items) <= 1 or THREADS == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(THREADS, len(items)), thread_name_prefix="pieces") as pool:
        return list(pool.map(fn, items))
