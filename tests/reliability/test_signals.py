"""`streamer up` in a terminal: Ctrl-C, a closed terminal, and `up` killed outright.

`up` runs in a pseudo-terminal that is its controlling terminal, as in a shell. Ctrl-C is
the byte ^C written to the terminal (the kernel sends SIGINT to the foreground process
group, as a real terminal does); a closed terminal is the master side closed (SIGHUP, and
stdout gone). Each must end with the trainer's final checkpoint, `up` exiting 0 or 130,
and no process of the run left behind. `up` SIGKILLed must not leave orphans either.
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
from pathlib import Path

import pytest
from harness import report
from trainer_data import REPO
from waits import wait_until

from consumers import checkpoint

pytestmark = pytest.mark.slow


class Terminal:
    """`streamer up` with a pty as its controlling terminal and stdin/stdout/stderr."""

    def __init__(self, data_dir: Path, *args: str):
        self.master, slave = os.openpty()
        self.output = bytearray()
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "streamer", "up", "--data-dir", str(data_dir), "--producers", "1"]
        self.proc = subprocess.Popen(
            [*argv, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,  # a session leader, like a login shell's job
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty is its terminal
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
