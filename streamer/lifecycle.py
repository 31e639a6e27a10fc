"""Process lifetimes under `streamer up`: who receives a terminal's signals, who outlives whom.

A terminal sends SIGINT (Ctrl-C) to its whole foreground process group and SIGHUP to it when
it closes. `up` alone should decide the order in which things stop (producers, evaluator,
trainer — which writes its final checkpoint — archiver, exporter, and the server last), so every child
it starts runs in a session of its own (``start_new_session=True``): no terminal signal
reaches it directly. The other half: a child must not outlive `up` when `up` itself dies
without stopping it (SIGKILL, the OOM killer). :func:`child_preexec` asks the Linux kernel
to send the child SIGTERM when its parent dies (``PR_SET_PDEATHSIG``) — the graceful signal,
so a trainer still checkpoints (Linux only; elsewhere stop `up` with a signal, not SIGKILL).

The second-signal rule, one for every process: the first SIGINT/SIGTERM/SIGHUP asks for a
graceful stop; a second one, while that stop is under way, means "now": `up` SIGKILLs the
roles (the trainer's last checkpoint stays valid; what was trained since is trained again
on the next start) and still stops the server cleanly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# seconds a role whose supervisor died has to stop before it exits anyway: the trainer's final
# checkpoint is worth a minute; the other roles have nothing to save that needs more than a few
ORPHAN_GRACE = 10.0
TRAINER_ORPHAN_GRACE = 60.0
_PARENT = os.getppid()  # who started this process (a fact of the process, read once)


def prctl(option: int, arg) -> bool:
    """Linux's ``prctl(option, arg)``; False where it failed or is not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_preexec(parent_pid: int, sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for Popen: the child gets ``sig`` when ``parent_pid`` dies.

    Runs between fork and exec (async-signal-safe work only). If the parent died before
    the request took effect, the child exits at once instead of running orphaned.
    """

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def exit_if_orphaned(what: str, grace: float = ORPHAN_GRACE) -> bool:
    """From a stop-signal handler: if our supervisor is gone, exit within ``grace`` seconds.

    The supervisor's death took the embedded server with it, so a graceful stop may wait on
    a server that will never answer; without this backstop such a role would live forever.
    A role stopped by a living supervisor (or by hand) is never cut short.
    """
    if os.getppid() == _PARENT:
        return False

    def fire() -> None:
        os.write(2, f"{what}: supervisor gone and not stopped after {grace:.0f}s; exiting\n".encode())
        os._exit(1)

    timer = threading.Timer(grace, fire)
    timer.daemon = True
    timer.start()
    return True


def on_stop_signals(
    stop: threading.Event,
    what: str,
    doing: str = "stopping",
    orphan_grace: float = ORPHAN_GRACE,
    then: Callable[[], None] | None = None,
) -> dict:
    """The stop handlers of a role: SIGTERM/SIGINT log, set ``stop``, arm the orphan
    backstop and call ``then``; the handlers that were there before come back, so a second
    signal is not graceful (the rule above). Returns those, for :func:`restore_signals`."""
    previous: dict = {}

    def on_signal(signum, _frame) -> None:
        log.info("%s: %s: %s", what, signal.Signals(signum).name, doing)
        stop.set()
        exit_if_orphaned(what, orphan_grace)
        restore_signals(previous)
        if then is not None:
            then()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    return previous


# SIGUSR1: `up` tells the trainer its producers are done (train what arrived, then stop). Taken
# from a process's first line (streamer.__main__), so one that comes while the trainer still
# loads is kept, not the default action (the end of the process).
finish_requested = threading.Event()


def take_finish_signal() -> None:
    signal.signal(signal.SIGUSR1, lambda *_: finish_requested.set())


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run_role(what: str, make: Callable[[], Any]) -> int:
    """A role's ``main``: the stop handlers, then ``make()``'s object (with ``run(stop)`` and
    ``close()``) run until SIGTERM/SIGINT and closed; exit 0."""
    stop = threading.Event()
    previous = on_stop_signals(stop, what)
    role = make()
    try:
        role.run(stop)
    finally:
        role.close()
        restore_signals(previous)
    return 0


class QuietStdout:
    """stdout that survives its reader going away (a closed terminal, ``up | head``).

    The first failed write switches output off instead of raising into the supervisor loop:
    the run is worth more than its progress lines. A closed terminal also sends SIGHUP,
    which is what stops `up`.
    """

    def __init__(self, stream):
        self.stream, self.closed_reader = stream, False

    def write(self, text: str) -> int:
        if not self.closed_reader:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self.closed_reader:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._lost()

    def _lost(self) -> None:
        self.closed_reader = True
        log.warning("stdout is closed; continuing without progress output")
        try:  # the interpreter's own flush at exit must not fail either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return not self.closed_reader and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name):
        return getattr(self.stream, name)


GRACE_SECONDS = 30.0  # per child, after SIGTERM, before SIGKILL


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: Any = None  # a subprocess.Popen, or a streamer.cli.forkserver.Forked
    stopping: bool = False
    group: bool = False  # signal its whole process group (an engine and its worker processes)
    env: dict[str, str] | None = None  # its own environment instead of the roles'
    forks: Any = None  # a streamer.cli.forkserver.ForkServer that forks it, if it can

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.forks is not None:
            self.proc = self.forks.spawn(self.name, self.argv, self.log_path)
            if self.proc is not None:
                return
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env or env,
                start_new_session=True,  # Ctrl-C reaches `up`, which stops us in order
                preexec_fn=child_preexec(os.getpid()),  # and `up` dying stops us too
            )

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def stop(self, grace: float = GRACE_SECONDS) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.exited()
        self.stopping = True
        self._signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", self.name, grace)
            self._signal(signal.SIGKILL)
            return self.proc.wait()

    def signal(self, sig: int) -> None:
        """Send ``sig`` if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(sig)

    def kill(self) -> None:
        """SIGKILL now (the second signal): the last checkpoint stays the resume point."""
        if self.proc is not None and self.proc.poll() is None:
            self.stopping = True
            self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig) if self.group else self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "".join(line.decode(errors="replace") for line in deque(f, maxlen=lines))
        except OSError:
            return ""
