"""Checkpoints: exact round trips without pickle, damaged ones skipped, the audit chain,
and SIGKILL at random points: every group trained exactly once into the persisted model."""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import time

import pytest
import torch
from bounds import RUN, START
from trainer_data import make_group, policy_versions, publish, start_trainer, trainer_config
from waits import wait_until

from consumers import checkpoint
from consumers.batch import collate
from consumers.learner import Learner
from streamer import demo, weights
from streamer.config import TrainerSection
from streamer.connection import connect
from streamer.keys import TRAINER_GROUP, Keys

CFG = TrainerSection(lr=1e-2, ppo_minibatches=2)


def _batch(seed: int):
    rng = random.Random(seed)
    return collate([make_group(rng, rewards=(1, 0, 0.5, 0)) for _ in range(2)])


def _learner(seed: int = 0) -> Learner:
    return Learner(demo.build_model(seed), CFG)


def _save(root, learner, *, step, version, parent=None, groups=("g",)):
    return checkpoint.save(
        root,
        model=learner.model,
        optimizer_state=learner.optimizer.state_dict(),
        step=step,
        version=version,
        parent=parent,
        covered=checkpoint.Covered(f"{version}-0", [f"{version}-0"], list(groups)),
    )


def test_round_trip_is_exact(tmp_path):
    a = _learner()
    a.train_step(_batch(0))
    random.seed(5)
    torch.manual_seed(5)
    meta = _save(tmp_path, a, step=1, version=3)
    expect_torch, expect_py = torch.rand(3), random.random()

    b = _learner(seed=99)  # different initial weights, empty optimizer
    path, found = checkpoint.latest(tmp_path)
    assert found == meta and path.name == "step-00000001-v00000003"
    checkpoint.restore(path, found, model=b.model, optimizer=b.optimizer)
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][pid][key]), (pid, key)
    suffixes = {p.suffix for p in path.rglob("*") if p.is_file()}
    assert suffixes <= {".safetensors", ".json"}, suffixes  # no pickle anywhere


def test_resumed_training_matches_uninterrupted(tmp_path):
    straight = _learner()
    for s in range(2):
        straight.train_step(_batch(s))
    first = _learner()
    first.train_step(_batch(0))
    _save(tmp_path, first, step=1, version=1)
    resumed = _learner(seed=7)
    path, meta = checkpoint.latest(tmp_path)
    checkpoint.restore(path, meta, model=resumed.model, optimizer=resumed.optimizer)
    resumed.step = meta.step
    resumed.train_step(_batch(1))
    for (name, pa), pb in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7, msg=name)


def test_a_version_is_renamed_into_place_without_fsync_and_a_checkpoint_is_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    learner = _learner()
    weights.write_version(learner.model, tmp_path / "weights", 1)
    assert synced == [] and weights.versions(tmp_path / "weights") == [1]
    meta = _save(tmp_path / "ckpt", learner, step=1, version=1)
    for rel in meta.files:  # every file, under its temporary name, before the rename
        assert any(s.endswith(rel) and "/.tmp-" in s for s in synced), (rel, synced)
    assert str(tmp_path / "ckpt") in synced  # and the rename


def test_damaged_and_partial_checkpoints_are_skipped(tmp_path, caplog):
    learner = _learner()
    good = _save(tmp_path, learner, step=1, version=1)
    bad = _save(tmp_path, learner, step=2, version=2, parent=good.name)
    opt = tmp_path / bad.name / "optimizer.safetensors"
    data = bytearray(opt.read_bytes())
    data[-1] ^= 0xFF
    opt.write_bytes(bytes(data))
    (tmp_path / "step-00000003-v00000003").mkdir()  # a directory without state.json
    (tmp_path / ".tmp-step-00000004-v00000004-x").mkdir()  # a crash mid-write
    with caplog.at_level(logging.WARNING, logger="consumers.checkpoint"):
        path, meta = checkpoint.latest(tmp_path)
    assert meta == good
    assert "step-00000002-v00000002" in caplog.text and "sha256" in caplog.text
    assert "step-00000003-v00000003" in caplog.text


def test_prune_keeps_the_audit_chain(tmp_path):
    learner = _learner()
    parent = None
    for v in range(1, 4):
        parent = _save(tmp_path, learner, step=v, version=v, parent=parent, groups=[f"g{v}a", f"g{v}b"]).name
    assert checkpoint.prune(tmp_path, keep=1) == ["step-00000002-v00000002", "step-00000001-v00000001"]
    assert [p.name for p in (tmp_path / "step-00000001-v00000001").iterdir()] == ["state.json"]
    chain = checkpoint.audit_chain(tmp_path)
    assert [m.version for m in chain] == [1, 2, 3]
    assert [g for m in chain for g in m.group_ids] == ["g1a", "g1b", "g2a", "g2b", "g3a", "g3b"]


# ---------------------------------------------------------------- crash test


def _trained(ckpt_dir) -> list[str]:
    return [g for m in checkpoint.audit_chain(ckpt_dir) for g in m.group_ids]


def _assert_versions_never_repeat(client, keys):
    versions = [v for v, _ in policy_versions(client, keys.policy)]
    assert versions == sorted(set(versions)), versions


@pytest.mark.slow
def test_sigkill_at_random_points_trains_each_group_exactly_once(private_valkey, tmp_path):
    rng = random.Random(20261202)
    client = connect(private_valkey.url)
    keys = Keys("crash")
    steps, per_step = 20, 2
    good = [make_group(rng, rewards=(1, 0, 0, 1)) for _ in range(steps * per_step)]
    bad = [make_group(rng, rewards=(1, 1, 1, 1)) for _ in range(3)]  # zero variance: rejected
    stream = list(good)
    for g in bad:
        stream.insert(rng.randrange(len(stream)), g)
    publish(client, keys.traj, stream)
    trainer = {"groups_per_step": per_step, "steps": steps, "max_staleness": 1000, "keep_checkpoints": 1}
    config = trainer_config(tmp_path, keys.run, bus={"max_deliveries": 50}, trainer=trainer)
    ckpt_dir = tmp_path / "data" / keys.run / "checkpoints"
    log = tmp_path / "trainer.log"
    persisted: list[str] = []
    restores = 0  # starts that found a checkpoint on disk, so must log its restore
    for kill in range(4):
        before = client.xlen(keys.policy)
        restores += checkpoint.latest(ckpt_dir) is not None
        proc = start_trainer(config, private_valkey.url, log)
        target = before + 1 + rng.randint(2, 5)  # the restored weights, then 2-5 steps
        wait_until(  # the first kill waits for a checkpoint too: every restart resumes
            lambda target=target, kill=kill, proc=proc: (
                proc.poll() is not None
                or (
                    client.xlen(keys.policy) >= target
                    and (kill > 0 or checkpoint.latest(ckpt_dir) is not None)
                )
            ),
            timeout=START,
            what=f"{target} weight syncs" + ("" if kill else " and a checkpoint"),
        )
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, 0.05))  # a random point of the step/sync/checkpoint cycle
            proc.kill()
        # else the steps ran out before the target (each takes ~10 ms here): it must have
        # finished cleanly, and every later start restores the last checkpoint and stops
        assert proc.wait(30) in (0, -signal.SIGKILL), log.read_text()[-3000:]
        trained = _trained(ckpt_dir)
        counts = collections.Counter(trained)
        assert not [g for g, n in counts.items() if n > 1], f"kill {kill}: trained twice"
        assert trained[: len(persisted)] == persisted, f"kill {kill}: persisted history changed"
        persisted = trained
        _assert_versions_never_repeat(client, keys)

    restores += checkpoint.latest(ckpt_dir) is not None
    proc = start_trainer(config, private_valkey.url, log)
    assert proc.wait(RUN) == 0, log.read_text()[-3000:]
    trained = _trained(ckpt_dir)
    assert sorted(trained) == sorted(g.group_id for g in good), "a group was lost or trained twice"
    assert not {g.group_id for g in bad} & set(trained)
    assert checkpoint.audit_chain(ckpt_dir)[-1].step == steps
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0
    assert client.xlen(keys.traj) == 0  # everything acknowledged and trimmed
    _assert_versions_never_repeat(client, keys)
    assert restores == 4 and log.read_text().count("restored checkpoint") == restores
