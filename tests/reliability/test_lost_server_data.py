"""Versions that mean what they say after a crash or a lost server.

1. The server loses its data (no persistence, or flushed) while checkpoints exist: the
   trainer detects it (the run's marker key is gone), says so with the way out, takes its
   next version from max(checkpoint, weights on disk, server) so no number repeats, never
   prunes the newest weights, and the next restart resumes from the newest checkpoint.
2. Staleness after a restore is the distance along the version tree (consumers/lineage.py):
   a group sampled by a version the restart discarded is judged by its true distance, and
   a group sampled by an ancestor is not penalised for the jump in version numbers.
"""

from __future__ import annotations

import random
import shutil

import pytest
from harness import report, run_config_in
from trainer_data import make_group, policy_versions, publish
from waits import wait_until

from consumers import checkpoint
from schemas import MetricsEvent
from streamer import weights
from streamer.bus import entry_event
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


def _train_metrics(client, keys: Keys) -> list[dict]:
    events = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    return [e.values for e in events if e.axis == "train"]


def _groups(rng, n: int, version: int = 0):
    return [make_group(rng, version=version, rewards=(1.0, 0.0, 0.0, 1.0)) for _ in range(n)]


def test_a_server_that_lost_its_data_reuses_no_version_and_prunes_nothing_new(
    private_valkey, procs, tmp_path
):
    url, keys, rng = private_valkey.url, Keys("lost"), random.Random(5)
    trainer = {"groups_per_step": 2, "checkpoint_every": 2, "keep_versions": 2, "max_staleness": 100}
    config = run_config_in(tmp_path, keys, trainer=trainer)
    ckpts, wdir = tmp_path / "data" / keys.run / "checkpoints", tmp_path / "data" / keys.run / "weights"
    args = ("--config", str(config), "--redis-url", url)
    client = connect(url)
    publish(client, keys.traj, _groups(rng, 8))
    procs.start("trainer", "train", *args)
    wait_until(
        lambda: (f := checkpoint.latest(ckpts)) and f[1].step == 4, timeout=180, what="step 4", watch=procs
    )
    before = checkpoint.latest(ckpts)[1]
    procs.procs["trainer"].kill()
    procs.procs["trainer"].wait(30)

    private_valkey.kill()  # a server without persistence, restarted: everything is gone
    shutil.rmtree(private_valkey.data_dir)
    private_valkey.start()
    client = connect(url)
    assert client.dbsize() == 0
    publish(client, keys.traj, _groups(rng, 4))
    procs.start("trainer2", "train", *args)
    wait_until(lambda: client.get(keys.version) == b"7", timeout=180, what="version 7", watch=procs)
    log = procs.log("trainer2")
    assert "the server lost its data" in log and f"resumes from {before.name}" in log, log[-3000:]
    versions = [v for v, _ in policy_versions(client, keys.policy)]
    assert versions == [5, 6, 7], versions  # one past the checkpoint's v4: no number reused
    wait_until(lambda: weights.versions(wdir)[-1:] == [7], timeout=30, what="v7 on disk")
    assert client.hget(keys.run_marker, "resumed_from") == before.name.encode()
    procs.stop("trainer2")
    newest = checkpoint.latest(ckpts)[1]
    assert newest.step == 6 and newest.version == 7, newest.name
    report(
        "server-lost-data",
        checkpoint_before=before.name,
        versions_after=versions,
        newest_checkpoint=newest.name,
        weights_on_disk=weights.versions(wdir),
    )


def test_staleness_after_a_restore_is_the_distance_along_the_version_tree(private_valkey, procs, tmp_path):
    url, keys, rng = private_valkey.url, Keys("tree"), random.Random(6)
    trainer = {"groups_per_step": 2, "checkpoint_every": 1000, "max_staleness": 1}
    config = run_config_in(tmp_path, keys, trainer=trainer, bus={"max_unacked": 1000})
    args = ("--config", str(config), "--redis-url", url)
    client = connect(url)
    procs.start("trainer", "train", *args)
    for v in range(4):  # 4 steps on fresh groups: v1..v4, never checkpointed
        wait_until(
            lambda v=v: client.get(keys.version) == str(v).encode(), timeout=180, what=f"v{v}", watch=procs
        )
        publish(client, keys.traj, _groups(rng, 2, version=v))
    wait_until(lambda: client.get(keys.version) == b"4", timeout=180, what="version 4", watch=procs)
    procs.procs["trainer"].kill()  # crash: v1..v4 are discarded, the restart restores step 0
    procs.procs["trainer"].wait(30)
    client.delete(keys.traj)  # only the groups below are judged (not the retraining of v0..v3's)
    procs.start("trainer2", "train", *args)
    wait_until(lambda: client.get(keys.version) == b"5", timeout=120, what="version 5", watch=procs)
    assert policy_versions(client, keys.policy)[-1] == (5, 0)  # the initial weights, renumbered
    # v4: 1 version number from v5 but 4 steps down a discarded branch; v0: 5 numbers, 0 steps
    publish(client, keys.traj, [*_groups(rng, 1, version=4), *_groups(rng, 2, version=0)])
    wait_until(lambda: client.get(keys.version) == b"6", timeout=120, what="version 6", watch=procs)
    procs.stop("trainer2")
    last = _train_metrics(client, keys)[-1]
    report(
        "staleness-after-restore",
        rejected_stale=last["groups_rejected_stale"],
        accepted=last["groups_accepted"],
        staleness_max=last["staleness_max"],
    )
    assert last["groups_rejected_stale"] == 1 and last["groups_accepted"] == 2
    assert last["staleness_max"] == 0.0
