"""Streams stay bounded when nothing trains: every group rejected (all-zero
rewards), no step, no checkpoint — the trajectory stream is trimmed anyway."""

from __future__ import annotations

import random

import pytest
from harness import report, run_config
from trainer_data import make_group, publish
from waits import wait_until

from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


def test_rejected_groups_are_trimmed_without_a_checkpoint(private_valkey, procs, tmp_path):
    url, keys, rng = private_valkey.url, Keys("flat"), random.Random(9)
    trainer = {"groups_per_step": 2, "checkpoint_every": 1000}
    bus = {"block_seconds": 0.5, "socket_timeout": 3.0}
    config = run_config(tmp_path / "run.toml", keys, tmp_path / "data", trainer=trainer, bus=bus)
    client = connect(url)
    procs.start("trainer", "train", "--config", str(config), "--redis-url", url)
    wait_until(
        lambda: client.xlen(keys.policy) >= 1, timeout=120, what="the trainer's first version", watch=procs
    )
    peak = 0
    for _ in range(10):  # 10 waves of 50 all-zero-reward groups
        publish(client, keys.traj, [make_group(rng, rewards=(0.0, 0.0, 0.0, 0.0)) for _ in range(50)])
        peak = max(peak, client.xlen(keys.traj))
    wait_until(lambda: client.xlen(keys.traj) < 50, timeout=60, what="rejected groups trimmed", watch=procs)
    added = client.xinfo_stream(keys.traj)["entries-added"]
    assert procs.stop("trainer") == 0, procs.tails()
    report(
        "rejected-trimmed",
        added=added,
        peak=peak,
        left=client.xlen(keys.traj),
        versions=client.xlen(keys.policy),
    )
    assert added == 500 and client.xlen(keys.policy) == 1  # nothing trained
