"""`streamer up` in a terminal: Ctrl-C, a closed terminal, and `up` killed outright.

`up` runs in a pseudo-terminal that is its controlling terminal, as in a shell. Ctrl-C is
the byte ^C written to the terminal (the kernel sends SIGINT to the foreground process
group, as a real terminal does); a closed terminal is the master side closed (SIGHUP, and
stdout gone). Each must end with the trainer's final checkpoint, `up` exiting 0 or 130,
and no process of the run left behind. `up` SIGKILLed must not leave orphans either.
A Ctrl-C at any point of start-up (stopped there, see :data:`STOP_AT`) stops `up` as well.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from harness import report
from trainer_data import REPO
from waits import wait_until

from consumers import checkpoint

pytestmark = pytest.mark.slow


class Terminal:
    """`streamer up` with a pty as its controlling terminal and stdin/stdout/stderr."""

    def __init__(
        self, data_dir: Path, *args: str, python: tuple[str, ...] = ("-m", "streamer"), sigint_ignored=False
    ):
        self.master, slave = os.openpty()
        self.output = bytearray()
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, *python, "up", "--data-dir", str(data_dir), "--producers", "1"]

        def preexec() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is its terminal
            if sigint_ignored:  # as a shell script's background job starts
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.proc = subprocess.Popen(
            [*argv, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,  # a session leader, like a login shell's job
            preexec_fn=preexec,
        )
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO once the other side is gone, EBADF once we closed it
                return
            if not data:
                return
            self.output += data

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def hang_up(self) -> None:
        os.close(self.master)

    def text(self) -> str:
        return self.output.decode(errors="replace")


def run_pids(marker: str) -> dict[int, str]:
    """Live processes whose command line or working directory mentions ``marker`` (the test's
    data dir; the server renames its process title but works in its data directory)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cmd += " cwd=" + os.readlink(proc / "cwd")
            state = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if marker in cmd and "zombie" not in state:
            out[int(proc.name)] = cmd
    return out


def _wait_for_training(data_dir: Path, term: Terminal) -> None:
    weights = data_dir / "demo" / "weights"
    wait_until(
        lambda: weights.is_dir() and len(list(weights.glob("v*"))) >= 3 or term.proc.poll() is not None,
        timeout=300,
        what="3 policy versions",
    )
    assert term.proc.poll() is None, term.text()


def _assert_final_checkpoint(data_dir: Path) -> int:
    log = (data_dir / "demo" / "logs" / "train.log").read_text()
    m = re.search(r"stopped at step (\d+), version (\d+)", log)
    assert m, log[-3000:]
    step = int(m.group(1))
    found = checkpoint.latest(data_dir / "demo" / "checkpoints")
    assert found is not None and found[1].step == step, (found, log[-3000:])
    return step


@pytest.mark.parametrize("how", ["ctrl-c", "hangup"])
def test_up_in_a_terminal_stops_in_order_and_leaves_nothing(tmp_path, how):
    data_dir = tmp_path / "data"
    term = Terminal(data_dir, "--steps", "100000")
    try:
        _wait_for_training(data_dir, term)
        before = run_pids(str(data_dir))
        assert len(before) == 7, before  # up, server, trainer, producer, evaluator, archiver, exporter
        term.ctrl_c() if how == "ctrl-c" else term.hang_up()
        code = term.proc.wait(timeout=180)
    finally:
        if term.proc.poll() is None:
            os.killpg(term.proc.pid, signal.SIGKILL)
    wait_until(lambda: not run_pids(str(data_dir)), timeout=30, what="no process of the run left")
    step = _assert_final_checkpoint(data_dir)
    assert code in (0, 130), term.text()[-3000:]
    if how == "ctrl-c":
        assert "stopping (producers, evaluator, trainer, archiver, exporter, server)" in term.text()
    report(f"signals-{how}", exit=code, processes_before=len(before), left=0, final_step=step)


def test_up_killed_outright_takes_its_children_with_it(tmp_path):
    data_dir = tmp_path / "data"
    term = Terminal(data_dir, "--steps", "100000")
    try:
        _wait_for_training(data_dir, term)
        before = run_pids(str(data_dir))
        assert len(before) == 7, before
        term.proc.kill()  # no chance to stop anything: the kernel tells the children
        term.proc.wait(30)
        wait_until(
            lambda: not run_pids(str(data_dir)),
            timeout=90,
            what=f"every child of the killed `up` to exit; left: {run_pids(str(data_dir))}",
        )
    finally:
        for pid in run_pids(str(data_dir)):
            os.kill(pid, signal.SIGKILL)
        term.hang_up()
    report("signals-sigkill-up", processes_before=len(before), left=0)


# `python -c STOP_AT WHAT AT up ...` runs `python -m streamer up ...`, SIGSTOPping itself once
# at one point of start-up: before the first import of module AT (WHAT = import), or right
# after starting the child process AT (WHAT = start: valkey-server, or a role's command,
# started or forked).
STOP_AT = """
import os, runpy, signal, subprocess, sys
what, at = sys.argv[1:3]
sys.argv = [sys.argv[0], *sys.argv[3:]]

class StopBefore:
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGSTOP)

init = subprocess.Popen.__init__

def start(self, args, *rest, **kw):
    init(self, args, *rest, **kw)
    if at in [os.path.basename(str(a)) for a in args] and not getattr(start, "done", False):
        start.done = True
        os.kill(os.getpid(), signal.SIGSTOP)

def spawned(self, name, argv, log_path):  # a role forked by up's streamer.cli.forkserver
    proc = spawn(self, name, argv, log_path)
    if at in argv and not getattr(start, "done", False):
        start.done = True
        os.kill(os.getpid(), signal.SIGSTOP)
    return proc

if what == "import":
    sys.meta_path.insert(0, StopBefore())
else:
    from streamer.cli import forkserver

    subprocess.Popen.__init__ = start
    spawn, forkserver.ForkServer.spawn = forkserver.ForkServer.spawn, spawned
runpy.run_module("streamer", run_name="__main__", alter_sys=True)
"""
START_POINTS = [  # in the order `up` reaches them
    ("import", "streamer.cli"),  # the command line's imports (the first after `python -m streamer`)
    ("import", "numpy"),
    ("import", "streamer.cli.up"),  # the arguments parsed, the config resolved
    ("import", "producers.eval_sets"),  # up's first step
    ("start", "valkey-server"),
    ("start", "metrics"),
    ("start", "archive"),
    ("start", "train"),  # the roles that run a model: last, once the fork server has imported torch
    ("start", "eval"),
    ("start", "produce"),  # the last child
]


def _proc_field(pid: int, name: str) -> str:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(name))
    return line.split(":", 1)[1].strip()


@pytest.mark.parametrize("sigint", ["default", "ignored"])
@pytest.mark.parametrize("what, at", START_POINTS, ids=[f"{w}-{a}" for w, a in START_POINTS])
def test_ctrl_c_at_any_point_of_start_up_stops_up(tmp_path, what, at, sigint):
    """`up` stopped at a point of its start-up gets ^C from its terminal, then goes on: it
    must stop whatever it started and exit 130, no traceback. ``ignored``: `up` starts with
    SIGINT ignored (a shell script's background job, `kill -INT` sent to it); its own
    handling takes over from `python -m streamer`'s first line, as it does later on."""
    data_dir = tmp_path / "data"
    term = Terminal(data_dir, python=("-c", STOP_AT, what, at), sigint_ignored=sigint == "ignored")
    pid = term.proc.pid
    try:
        wait_until(
            lambda: term.proc.poll() is not None or _proc_field(pid, "State").startswith("T"),
            timeout=60,
            what=f"up to reach {what} {at}",
        )
        assert term.proc.poll() is None, f"up exited before {what} {at}:\n{term.text()[-3000:]}"
        started = len(run_pids(str(data_dir))) - 1  # besides up itself
        term.ctrl_c()
        wait_until(  # queued while up is stopped; a SIGINT up ignores is discarded at once
            lambda: int(_proc_field(pid, "ShdPnd"), 16) & (1 << (signal.SIGINT - 1)),
            timeout=10,
            what=f"the ^C to be pending (it was discarded: up ignores SIGINT at {what} {at})",
        )
        sent = time.monotonic()
        os.kill(pid, signal.SIGCONT)
        try:
            code = term.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"^C at {what} {at}: up carried on\n{term.text()[-3000:]}") from None
        seconds = time.monotonic() - sent
    finally:
        if term.proc.poll() is None:
            os.killpg(pid, signal.SIGKILL)
    wait_until(
        lambda: not run_pids(str(data_dir)),
        timeout=60,
        what=f"no process of the run left; left: {run_pids(str(data_dir))}",
    )
    out = term.text()
    assert code == 130 and "Traceback" not in out, f"exit {code}\n{out[-3000:]}"
    if what == "start" and at != "valkey-server":  # roles started: stopped in order
        assert "streamer up: stopping (" in out, out[-3000:]
    report(f"signals-start-{at}-{sigint}", exit=code, started=started, left=0, seconds=f"{seconds:.2f}")
