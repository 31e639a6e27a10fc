"""`streamer up` keeps the server's password off every command line (`/proc/*/cmdline` is
readable by every local user): the URL reaches `up` and its children in the environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer.config import URL_ENV
from streamer.server import EmbeddedServer

pytestmark = pytest.mark.slow

SECRET = "s3cret-do-not-show"
ROLE = re.compile(r" -m streamer (?:--log-level \S+ )?(\w+)")


def _children(pid: int) -> set[int]:
    """``pid``'s descendants, from /proc/*/stat."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rpartition(")")[2].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def _cmdlines(pids) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def test_up_hands_children_the_url_in_the_environment_not_argv(tmp_path):
    server = EmbeddedServer(tmp_path / "valkey", password=SECRET).start()
    try:
        assert oct((tmp_path / "valkey" / "auth.conf").stat().st_mode & 0o777) == "0o600"
        assert SECRET not in _cmdlines([server.proc.pid])[server.proc.pid]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", URL_ENV: server.url, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "streamer", "up", "--data-dir", str(tmp_path / "data")]
        up = subprocess.Popen(
            [*argv, "--no-progress", "--steps", "2", "--producers", "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen: dict[int, str] = {}
        expected = ["archive", "eval", "metrics", "produce", "produce", "train", "up"]

        def roles() -> list[str]:
            return sorted(m.group(1) for c in seen.values() if (m := ROLE.search(c)))

        try:
            deadline = time.monotonic() + 120
            # every role started, or `up` already done. A child between fork and exec still
            # shows up's command line, so wait for the roles, not for a count of processes.
            while up.poll() is None and time.monotonic() < deadline:
                # a role that has exited reads as an empty command line until `up` waits for it
                seen.update((p, c) for p, c in _cmdlines(_children(up.pid) | {up.pid}).items() if c)
                if roles() == expected:
                    break
                time.sleep(0.2)
            out, _ = up.communicate(timeout=300)
        finally:
            up.kill()
        assert roles() == expected, (roles(), out)
        leaks = [c for c in seen.values() if SECRET in c]
        assert not leaks, f"the password appears on a command line: {leaks}"
        assert up.returncode == 0, out
        assert SECRET not in out
    finally:
        server.stop()
