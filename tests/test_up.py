"""`streamer up` end to end: real processes, the embedded server, the demo task."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from bounds import RUN, START
from runs import Up

from streamer.cli.up import Stack, cores, default_producers

pytestmark = pytest.mark.slow

STEPS = 80


def test_up_runs_the_demo_learns_and_exits_0(tmp_path):
    with Up(tmp_path, "--steps", str(STEPS)) as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0, out
    assert f"steps trained      {STEPS}" in out, out
    curve = json.loads((tmp_path / "demo" / "curve.json").read_text())
    rewards = {int(v): r for v, r in curve["reward_by_version"].items()}
    early = [r for v, r in rewards.items() if v < 10]
    late = [r for v, r in rewards.items() if v >= STEPS - 20]
    assert sum(late) / len(late) > sum(early) / len(early) + 0.05, rewards
    # the final version was scored on the held-out pairs; 80 steps are too few to expect those
    # above chance (0.1 at v80 on a quiet machine): the held-out figures are
    # bench/demo_curve.py's and bench/learning.py's, over 400-500 steps
    assert str(STEPS) in curve["eval_accuracy_by_version"], curve["eval_accuracy_by_version"]
    for axis in ("train", "rollout", "eval"):
        assert f"streamer_{axis}_step" in up.series, sorted(up.series)
    assert "streamer_train_loss" in up.series and "streamer_eval_accuracy" in up.series
    weights = sorted((tmp_path / "demo" / "weights").iterdir())
    assert weights and weights[-1].name == f"v{STEPS:08d}"
    # as many producers as the machine has cores beside the trainer's (1 to 4), no more
    n = default_producers(cores())
    assert f"; {n} producer{'s' if n > 1 else ''};" in out, out
    logs = sorted(p.name for p in (tmp_path / "demo" / "logs").glob("produce-*.log"))
    assert logs == [f"produce-{i}.log" for i in range(n)], logs


@pytest.mark.parametrize("together", [(), ("train",)])
def test_the_roles_stop_kind_by_kind_and_a_goal_reached_stops_the_trainer_with_the_producers(together):
    """Each kind of role is stopped once the kinds before it have exited; ``together``: kinds
    stopped at the same time as the producers."""
    import threading

    events, lock = [], threading.Lock()
    train_stopping = threading.Event()

    class Role:
        def __init__(self, name):
            self.kind = name.split("-")[0]

        def stop(self):
            with lock:
                events.append(("start", self.kind))
            if self.kind == "train":
                train_stopping.set()
            if self.kind == "produce" and together:  # the trainer's stop comes while this one runs
                assert train_stopping.wait(timeout=5), "the trainer was not stopped with the producers"
            with lock:
                events.append(("end", self.kind))

    Stack({n: Role(n) for n in ("metrics", "train", "eval", "produce-0")}).stop_children(
        with_producers=together
    )
    waves = [("produce",), ("eval",), ("train",), ("metrics",)]
    if together:
        waves = [("produce", "train"), ("eval",), ("metrics",)]
        assert events.index(("start", "train")) < events.index(("end", "produce")), events
    at = 0
    for wave in waves:  # a kind starts stopping only once every kind before it has stopped
        got = events[at : at + 2 * len(wave)]
        assert {k for _, k in got} == set(wave) and got[-1][0] == "end", events
        at += 2 * len(wave)


@pytest.mark.parametrize(("n_cores", "producers"), [(1, 1), (2, 1), (3, 2), (5, 4), (64, 4)])
def test_up_starts_one_producer_per_core_beside_the_trainers(n_cores, producers):
    assert default_producers(n_cores) == producers


def test_up_stops_in_order_on_sigterm_and_resumes(tmp_path):
    ckpts = tmp_path / "demo" / "checkpoints"
    with Up(tmp_path, "--steps", "1000") as up:
        deadline = time.monotonic() + RUN
        while not (ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
            assert up.proc.poll() is None, up.output()
            assert time.monotonic() < deadline, f"no checkpoint within {RUN:.0f} s"
            time.sleep(0.5)
        # the roles were forked from one preloaded process (streamer.cli.forkserver), which has
        # exited: each is up's own child, named and shown as the role it is
        children = _children(up.proc.pid)
        roles = [("train", " train "), ("eval", " eval "), ("produce-0", " produce ")]
        roles += [("metrics", " metrics "), ("archive", " archive ")]
        for name, role in roles:
            assert any(c == name and role in cmd for c, cmd, _ in children), children
        assert not any("forkserver" in cmd for _, cmd, _ in children), children
        for name, _, maps in children:  # forked before the server imported torch
            assert name not in ("metrics", "archive") or "libtorch" not in maps, name
        up.proc.send_signal(signal.SIGTERM)
        code = up.proc.wait(timeout=START)  # each child has up.GRACE_SECONDS, then is killed
    out = up.output()
    assert code == 130, out
    assert "stopping (producers, evaluator, trainer, archiver, exporter, server)" in out
    assert "did not stop within" not in out, out  # every child stopped within its grace period
    stopped_at = max(int(p.name.split("-")[1]) for p in ckpts.iterdir() if p.name.startswith("step-"))
    # the trainer's final checkpoint on SIGTERM: resume continues from it, not from zero
    with Up(tmp_path, "--steps", str(stopped_at + 5)) as again:
        code = again.proc.wait(timeout=RUN)
    assert code == 0, again.output()
    log = (tmp_path / "demo" / "logs" / "train.log").read_text()
    assert f"restored checkpoint step-{stopped_at:08d}" in log, log[-2000:]


def _children(pid: int) -> list[tuple[str, str, str]]:
    """(process name, command line, memory maps) of each live child of ``pid``."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            if proc.name.isdigit() and int(stat.rpartition(")")[2].split()[1]) == pid:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                maps = (proc / "maps").read_text()
                out.append((stat[stat.index("(") + 1 : stat.rindex(")")], cmd, maps))
        except OSError:
            continue
    return out


def test_a_crashing_child_is_reported_and_up_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[producer]\ndataset = "/nonexistent/rows.jsonl"\n')
    with Up(tmp_path, "--config", str(bad), "--steps", "5") as up:
        code = up.proc.wait(timeout=START)
    out = up.output()
    assert code == 1, out
    assert re.search(r"produce-\d exited with code 2", out), out
    assert "/nonexistent/rows.jsonl" in out  # the last lines of its log say why


def test_up_until_eval_stops_once_an_evaluation_reaches_the_target(tmp_path):
    with Up(tmp_path, "--steps", "500", "--until-eval", "0") as up:  # every evaluation reaches 0
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0, out
    assert re.search(r"eval accuracy \d\.\d\d >= 0: stopping", out), out
    assert "stopping (producers and trainer, evaluator, archiver, exporter, server)" in out, out
    assert int(re.search(r"steps trained +(\d+)", out).group(1)) < 500, out
