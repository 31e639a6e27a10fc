"""The tests' one poll-until-true: bounded, and loud when it fails.

``wait_until`` fails naming what it waited for, at once when a watched process died
meanwhile (with its exit code and log tail), else when the time runs out. A watch is
anything with ``crashed() -> str`` ("" while all is well) and ``tails() -> str``: the
reliability suite's ``harness.Procs``, or :class:`Watch` for plain ``Popen`` objects.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

T = TypeVar("T")


class Watched(Protocol):
    def crashed(self) -> str: ...

    def tails(self) -> str: ...


class Watch:
    """Processes whose exit (any exit: they are meant to keep running) fails a wait; the
    tails of ``log`` (a path, or several), or of the exited processes' piped stdout, go
    into the message."""

    def __init__(self, *procs: subprocess.Popen, log: Path | list[Path] | None = None):
        self.procs = procs
        self.logs = [] if log is None else [log] if isinstance(log, Path) else list(log)

    def crashed(self) -> str:
        gone = [(p.args, p.poll()) for p in self.procs if p.poll() is not None]
        return ", ".join(f"{_name(args)} exited with code {code}" for args, code in gone)

    def tails(self, chars: int = 3000) -> str:
        if self.logs:
            return "\n".join(f"--- {f.name}\n{_read(f)[-chars:]}" for f in self.logs)
        out = [p.stdout.read() for p in self.procs if p.poll() is not None and p.stdout is not None]
        return "\n".join(
            o.decode(errors="replace")[-chars:] if isinstance(o, bytes) else o[-chars:] for o in out
        )


def wait_until(
    cond: Callable[[], T],
    *,
    timeout: float,
    what: str,
    watch: Watched | None = None,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``cond`` until it returns something truthy, and return that. Exceptions of the
    ``ignore`` types count as "not yet" (a server still starting)."""

    def check():
        try:
            return cond()
        except ignore:
            return None

    deadline = time.monotonic() + timeout
    while not (value := check()):
        if watch is not None and (crashed := watch.crashed()):
            if value := check():  # it did what we waited for, then exited
                return value
            raise AssertionError(f"{crashed} while waiting for {what}\n{watch.tails()}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}\n{watch.tails() if watch else ''}"
            )
        time.sleep(interval)
    return value


def _name(args) -> str:
    return " ".join(str(a) for a in args[:6]) if isinstance(args, list | tuple) else str(args)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"
