"""Roles that run no model import no torch: the archiver, the exporter, the tracker (with
TensorBoard), `status`, `samples`, `plot` and `up` itself, each started for real (tests/role_modules.py) against a run with a
policy version, a rollout group and metrics on the server."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_data import make_group, publish

from schemas import MetricsEvent, WeightSync
from streamer import demo
from streamer.bus import Publisher
from streamer.config import RunConfig, write_toml
from streamer.server import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
START = 120  # seconds: a bound for a hung role, not a speed check


@pytest.fixture
def run(client, keys, redis_url, tmp_path):
    """A run with something for every command to read; its data dir."""
    publish(client, keys.traj, [make_group(random.Random(0), rewards=(1.0, 0.0, 0.0, 1.0))])
    sync = WeightSync(version=0, step=0, uri=(tmp_path / "w").as_uri(), sha256="0" * 64)
    events = [MetricsEvent(axis="train", step=s, values={"loss": 1.0 / s}, source="trainer") for s in (1, 2)]
    pub = Publisher(client, keys, RunConfig().bus)
    pub.publish_many(keys.policy, [sync])
    pub.publish_many(keys.metrics, events)
    return tmp_path / "data"


def _start(tmp_path: Path, ready: str, *argv: str) -> dict:
    out = tmp_path / f"{argv[0]}.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "role_modules.py"), str(out), ready, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=START,
    )
    assert proc.returncode == 0 and out.exists(), f"{argv[0]}: {proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert "error" not in report, f"{argv[0]}: {report['error']}\n{proc.stderr[-3000:]}"
    return report


def _heavy(report: dict) -> dict[str, list[str]]:
    """What was imported that should not be, at each point measured."""
    return {
        when: [m for m, seen in report[when].items() if seen]
        for when in ("at_ready", "at_end")
        if when in report
    }


def test_roles_that_run_no_model_import_neither_torch_nor_transformers(
    run, client, keys, redis_url, tmp_path
):
    common = ("--run", keys.run, "--redis-url", redis_url, "--data-dir", str(run))
    archive = run / keys.run / "archive"
    tokenizer = tmp_path / "model"  # a local model's tokenizer.json: decoded without transformers
    demo.tokenizer().save_pretrained(tokenizer)
    config = write_toml(tmp_path / "run.toml", {"model": {"name_or_path": str(tokenizer)}})
    reports = {"archive": _start(tmp_path, f"file:{archive}", "archive", *common)}
    publish(client, keys.traj, [make_group(random.Random(1), rewards=(1.0, 0.0, 0.0, 1.0))])
    reports |= {
        "archive, a local model": _start(
            tmp_path,
            f"file:{tmp_path / 'data2' / keys.run / 'archive'}",
            "archive",
            *common[:-1],
            str(tmp_path / "data2"),
            "--config",
            str(config),
        ),
        "samples": _start(tmp_path, "exit", "samples", *common),
        "status": _start(tmp_path, "exit", "status", *common),
        "plot": _start(tmp_path, "exit", "plot", *common, "--out", str(tmp_path / "run.png")),
    }
    port = free_port()
    reports["metrics"] = _start(tmp_path, f"http:{port}", "metrics", *common, "--port", str(port))
    tracking = write_toml(tmp_path / "track.toml", {"tracking": {"backend": "tensorboard"}})
    events = f"glob:{run / keys.run / 'tracking' / 'train'}/events.out.tfevents.*"
    reports["track"] = _start(tmp_path, events, "track", *common, "--config", str(tracking))
    reports["up"] = _start(tmp_path, "up", "up", *common, "--no-progress", "--producers", "1")
    assert {role: r["code"] for role, r in reports.items()} == {
        "archive": 0,
        "archive, a local model": 0,
        "samples": 0,
        "status": 0,
        "plot": 0,
        "metrics": 0,
        "track": 0,
        "up": 130,  # stopped by a signal
    }
    imported = {role: _heavy(r) for role, r in reports.items()}
    assert all(not names for r in imported.values() for names in r.values()), imported
