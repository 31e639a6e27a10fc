"""`streamer status` says why a run is not progressing, and exits 1 then: all
groups rejected (and why), the admission window full with nothing to train, no live
producers, the server's data lost. Against a real trainer process."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from harness import report, run_config
from trainer_data import REPO, make_group, publish
from waits import wait_until

from streamer.admission import Admission, Leases
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


def _status(config, url) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "streamer", "status", "--config", str(config), "--redis-url", url]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    return res.returncode, res.stdout + res.stderr


def test_status_names_each_reason_a_run_is_stuck(private_valkey, procs, tmp_path):
    url, keys, rng = private_valkey.url, Keys("why"), random.Random(2)
    trainer = {"groups_per_step": 2, "max_staleness": 0, "checkpoint_every": 1}
    config = run_config(
        tmp_path / "run.toml", keys, tmp_path / "data", trainer=trainer, metrics={"stall_seconds": 1.0}
    )
    client = connect(url)
    procs.start("trainer", "train", "--config", str(config), "--redis-url", url)
    wait_until(
        lambda: client.hget(keys.run_marker, "trainer") == b"running",
        timeout=120,
        what="trainer",
        watch=procs,
    )

    wait_until(lambda: _status(config, url)[0] == 1, timeout=30, what="a stall")
    code, out = _status(config, url)
    assert code == 1 and "no live producers (0 known)" in out, out
    seen = {"no_producers": code}

    publish(client, keys.traj, [make_group(rng, rewards=(0.0,) * 4) for _ in range(6)])
    wait_until(
        lambda: client.hget(keys.rejected_since_step, "zero_variance") == b"6", timeout=30, what="rejections"
    )
    code, out = _status(config, url)
    assert code == 1 and "all 6 groups since were rejected (zero_variance 6)" in out, out
    seen["all_rejected"] = code

    leases, admission = (
        Leases(client, keys, owner="stuck", lease_seconds=600),
        Admission(client, keys, max_staleness=0, groups_per_step=2),
    )
    for _ in range(2):  # rows leased and admitted, never published: the window is full
        assert admission.try_admit(leases.claim(), "stuck")
    code, out = _status(config, url)
    assert code == 1 and "the admission window is full (2 of 2 slots)" in out, out
    seen["window_full"] = code

    publish(client, keys.traj, [make_group(rng) for _ in range(2)])
    wait_until(
        lambda: (tmp_path / "data" / keys.run / "checkpoints").is_dir(), timeout=60, what="a checkpoint"
    )
    assert procs.stop("trainer") == 0, procs.tails()
    for key in client.scan_iter(match=keys.all_keys_pattern()):  # the server loses the run
        client.delete(key)
    code, out = _status(config, url)
    assert code == 1 and "the server lost this run's data: checkpoint step-" in out, out
    seen["data_lost"] = code
    report("status-says-why", **seen)
