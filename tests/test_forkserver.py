"""streamer.cli.forkserver: a role forked from the preloaded server is the caller's own child,
named and logged as if it had been started; a role that runs no model is forked before the
server imports torch; and a server that is gone starts nothing.

Each case runs in a process of its own (the launcher makes its caller a child subreaper,
which would outlive the case in pytest's process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bounds import START

ROOT = Path(__file__).resolve().parents[1]

CALLER = """
import json, os, sys, threading, time
from pathlib import Path
from streamer.cli.forkserver import ForkServer

case, log = sys.argv[1], Path(sys.argv[2])
argv = [sys.executable, "-m", "streamer", "--help"]
server = ForkServer.start(
    dict(os.environ), log.with_name("forkserver.log"), "demo", threading.Event(), 200, models=("train",)
)
maps = Path(f"/proc/{server.proc.pid}/maps")
out = {}
if case == "gone":
    server.proc.kill()
    server.proc.wait()
if case == "light first":
    light = server.spawn("metrics", argv, log.with_name("metrics.log"))
    out["light code"] = light.wait(60)
    out["torch before"] = "libtorch" in maps.read_text()
role = server.spawn("train", argv, log)
if case == "light first":
    out["torch after"] = "libtorch" in maps.read_text()
out["spawned"] = role is not None
out["broken"] = server.broken
if role is not None:
    stat = Path(f"/proc/{role.pid}/stat")
    deadline = time.monotonic() + 60
    while stat.read_text().rpartition(")")[2].split()[0] != "Z":  # exited, not yet waited for
        assert time.monotonic() < deadline, "the forked role did not exit"
        time.sleep(0.01)
    fields = stat.read_text()
    out["comm"] = fields[fields.index("(") + 1 : fields.rindex(")")]
    out["ppid"] = int(fields.rpartition(")")[2].split()[1])
    out["code"] = role.wait(10)
server.close()
out["me"] = os.getpid()
print(json.dumps(out))
"""


def _call(case: str, tmp_path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CALLER, case, str(tmp_path / "train.log")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_forked_role_is_the_callers_child_named_and_logged_as_its_role(tmp_path):
    out = _call("forked", tmp_path)
    assert out["spawned"] and not out["broken"], out
    assert out["ppid"] == out["me"], out  # handed to the caller, which waited for it
    assert out["comm"] == "train", out
    assert out["code"] == 0, out
    assert "usage: streamer" in (tmp_path / "train.log").read_text()


def test_a_server_that_is_gone_forks_nothing_and_says_so(tmp_path):
    out = _call("gone", tmp_path)
    assert not out["spawned"] and out["broken"], out  # the caller starts the role the usual way
    assert not (tmp_path / "train.log").exists()


def test_a_role_that_runs_no_model_is_forked_before_the_server_imports_torch(tmp_path):
    out = _call("light first", tmp_path)
    assert out["light code"] == 0 and "usage: streamer" in (tmp_path / "metrics.log").read_text(), out
    assert not out["torch before"], out  # the exporter's process never held torch
    assert out["torch after"] and out["spawned"] and out["code"] == 0, out
