"""The trainer against a real server: filters and admission slots, exactly-once around a crash
between checkpoint and XACK (in process), and `python -m streamer train` end to end."""

from __future__ import annotations

import collections
import logging
import random
import signal
import threading

import pytest
from bounds import START
from trainer_data import make_group, policy_versions, publish, start_trainer, trainer_config
from waits import Watch, wait_until

from consumers import checkpoint, trainer
from consumers.batch import collate
from consumers.feed import Feeder
from consumers.filters import GroupFilter
from consumers.learner import Learner
from schemas import MetricsEvent, WeightSync
from schemas.metric_names import TRAIN
from streamer import demo, weights
from streamer.admission import Admission
from streamer.bus import entry_event
from streamer.config import BusSection, RunConfig, TrainerSection, replace
from streamer.connection import connect
from streamer.errors import ConfigError
from streamer.keys import TRAINER_GROUP, Keys
from streamer.tail import Tail


def _cfg(url, keys, tmp_path, **trainer_fields) -> RunConfig:
    fields = {"groups_per_step": 2, "lr": 1e-3, "max_staleness": 1, **trainer_fields}
    run = {"name": keys.run, "redis_url": url, "data_dir": str(tmp_path)}
    return replace(RunConfig(), run=run, trainer=fields)


def _trainer(cfg: RunConfig, client, keys) -> trainer.Trainer:
    learner = Learner(demo.build_model(cfg.run.seed), cfg.trainer)
    return trainer.Trainer(cfg, client, keys, learner, stop=threading.Event())


def _metrics(client, keys) -> list[MetricsEvent]:
    return [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]


def _trained(cfg: RunConfig) -> list[str]:
    return [g for m in checkpoint.audit_chain(cfg.checkpoint_dir) for g in m.group_ids]


def _feeder(client, keys, **kw) -> Feeder:
    return Feeder(
        client,
        keys,
        name="t0",
        bus=BusSection(),
        admission=Admission(client, keys, max_staleness=0, groups_per_step=2),
        group_filter=GroupFilter(max_staleness=100),
        groups_per_step=2,
        collate=collate,
        version=lambda: 0,
        block_seconds=0.1,
        **kw,
    ).start()


def test_feed_trains_in_stream_order_when_groups_come_back(keys, client):
    rng = random.Random(5)
    ids = publish(client, keys.traj, [make_group(rng) for _ in range(6)])
    feeder = _feeder(client, keys)
    try:
        first = feeder.next(timeout=10)
        assert first.entry_ids == ids[:2]
        wait_until(lambda: feeder._ready is not None, timeout=10, what="the batch built ahead")
        feeder.reject([(ids[0], "stale")])  # what the step loop does with a group gone stale
        feeder.give_back([(ids[1], first.groups[1])])
        order = feeder.next(timeout=10).entry_ids + feeder.next(timeout=10).entry_ids
        assert order == ids[1:5]  # the group handed back goes first, then the rest in order
        assert feeder.next(timeout=0.3) is None  # one group left: not a batch
        assert feeder.take_rejections() == {"stale": 1}
    finally:
        feeder.stop()


def test_feed_acknowledges_what_the_checkpoint_covers(keys, client):
    rng = random.Random(6)
    ids = publish(client, keys.traj, [make_group(rng) for _ in range(4)])
    feeder = _feeder(client, keys, high_water=ids[1])
    try:
        assert feeder.next(timeout=10).entry_ids == ids[2:]
        pending = {
            r["message_id"].decode() for r in client.xpending_range(keys.traj, TRAINER_GROUP, "-", "+", 10)
        }
        assert pending == set(ids[2:])  # the covered ones were acknowledged, not trained
    finally:
        feeder.stop()


def test_entries_a_checkpoint_covers_are_not_trained_again_when_delivered_again(keys, client):
    """A failed-over cluster master (or an AOF that had not reached disk) can come back with
    the trainer's acknowledgements, and even its group's read position, missing: the entries
    a checkpoint written since the feed started covers come again, and are only acknowledged."""
    rng = random.Random(7)
    client.xgroup_create(keys.traj, "audit", id="0", mkstream=True)  # keeps them from being trimmed
    ids = publish(client, keys.traj, [make_group(rng) for _ in range(2)])
    feeder = _feeder(client, keys)
    try:
        ready = feeder.next(timeout=10)
        feeder.trained(ready)
        feeder.checkpointed(feeder.covered())
        client.xgroup_setid(keys.traj, TRAINER_GROUP, "0")  # as if the reads and acks were lost
        newer = publish(client, keys.traj, [make_group(rng) for _ in range(2)])
        assert feeder.next(timeout=10).entry_ids == newer
        pending = {
            r["message_id"].decode() for r in client.xpending_range(keys.traj, TRAINER_GROUP, "-", "+", 10)
        }
        assert pending == set(newer) and ready.entry_ids == ids
    finally:
        feeder.stop()


def test_rejections_release_slots_and_are_counted(redis_url, keys, client, tmp_path):
    rng = random.Random(1)
    client.set(keys.version, 5)  # an earlier trainer got to version 5: this one publishes 6
    stale = make_group(rng, version=4)  # 6 - 4 > max_staleness 1
    flat = make_group(rng, version=5, rewards=(1, 1, 1, 1))
    overlong = make_group(rng, version=5, rewards=(1, 0, 1), finishes=["length"] * 3)
    lonely = make_group(rng, version=5, rewards=(1,))
    good = [make_group(rng, version=v) for v in (5, 6)]
    ids = publish(client, keys.traj, [stale, flat, overlong, lonely, *good])
    client.sadd(keys.held_slots, *ids[1:])  # as the producers' admission would have (not `stale`)
    client.set(keys.admitted, 77)  # and a counter a bug left wrong: the trainer recounts it
    cfg = _cfg(redis_url, keys, tmp_path, steps=1)
    assert _trainer(cfg, client, keys).run() == 0

    # the rejected groups gave their slots back, the trained ones too, and the one that never
    # held a slot gave back nothing: exactly zero, never negative
    assert int(client.get(keys.admitted)) == 0 and client.scard(keys.held_slots) == 0
    assert policy_versions(client, keys.policy) == [(6, 0), (7, 1)]
    assert int(client.get(keys.version)) == 7
    assert client.hgetall(keys.limits) == {b"max_staleness": b"1", b"groups_per_step": b"2"}
    [event] = _metrics(client, keys)
    assert event.axis == "train" and event.step == 1 and event.source == "trainer"
    assert set(event.values) == set(TRAIN)
    prefix = "groups_rejected_"
    rejected = {k.removeprefix(prefix): v for k, v in event.values.items() if k.startswith(prefix)}
    expected = {"stale": 1, "zero_variance": 1, "overlong": 1, "too_few_samples": 1, "user_filter": 0}
    assert rejected == {**expected, "too_long": 0}
    assert event.values["groups_accepted"] == 2
    assert event.values["staleness_max"] == 1 and event.values["staleness_mean"] == 0.5
    assert event.values["version"] == 7
    assert _trained(cfg) == [g.group_id for g in good]
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0
    assert client.xlen(keys.traj) == 0


class _Crash(Exception):
    pass


def test_crash_between_checkpoint_and_ack_trains_nothing_twice(
    redis_url, keys, client, tmp_path, monkeypatch, caplog
):
    rng = random.Random(2)
    groups = [make_group(rng) for _ in range(6)]
    publish(client, keys.traj, groups)
    cfg = _cfg(redis_url, keys, tmp_path, steps=3, checkpoint_every=2, max_staleness=100)

    def die_before_the_ack(self, covered, **kw):
        raise _Crash  # the checkpoint is on disk, no XACK yet

    with monkeypatch.context() as m:
        m.setattr(Feeder, "checkpointed", die_before_the_ack)
        with pytest.raises(_Crash):
            _trainer(cfg, client, keys).run()
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] >= 4  # trained, checkpointed, not acked

    with caplog.at_level(logging.INFO, logger="consumers.feed"):
        assert _trainer(cfg, client, keys).run() == 0
    assert "acknowledged 4 pending entries the checkpoint already covers" in caplog.text
    assert _trained(cfg) == [g.group_id for g in groups]  # in order, each exactly once
    assert [v for v, _ in policy_versions(client, keys.policy)] == [0, 1, 2, 3, 4]
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0


def test_checkpoint_every_counts_from_the_last_checkpoint_an_early_one_included(
    redis_url, keys, client, tmp_path
):
    rng = random.Random(4)
    publish(client, keys.traj, [make_group(rng) for _ in range(24)])
    cfg = _cfg(redis_url, keys, tmp_path, steps=12, checkpoint_every=6, max_staleness=100)
    cfg = replace(cfg, bus={"max_unacked": 16})  # early once 4 steps (8 groups) wait for one
    assert _trainer(cfg, client, keys).run() == 0
    assert [m.step for m in checkpoint.audit_chain(cfg.checkpoint_dir)] == [4, 8, 12]


@pytest.mark.slow
def test_train_process_lock_step_with_a_publisher(private_valkey, tmp_path):
    """`streamer train` as a process, fed on-policy groups sampled from each published version."""
    client = connect(private_valkey.url)
    keys = Keys("e2e")
    steps, per_step = 3, 2
    config = trainer_config(
        tmp_path, keys.run, trainer={"groups_per_step": per_step, "steps": steps, "max_staleness": 0}
    )
    weights_dir = tmp_path / "data" / keys.run / "weights"
    log = tmp_path / "trainer.log"
    proc = start_trainer(config, private_valkey.url, log)
    rng, model = random.Random(3), demo.build_model(0)
    published = []
    try:
        for step in range(steps):
            wait_until(
                lambda step=step: client.xlen(keys.policy) == step + 1,
                timeout=START,
                what=f"version {step}",
                watch=Watch(proc, log=log),
            )
            sync = Tail(client, keys.policy, as_type=WeightSync).latest()
            weights.load_into(model, weights.resolve(sync, weights_dir))  # sample with the newest policy
            batch = [make_group(rng, version=sync.version, model=model) for _ in range(per_step)]
            if step == 0:
                batch.insert(1, make_group(rng, version=sync.version, rewards=(0, 0, 0, 0)))
            publish(client, keys.traj, batch)
            published += batch
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    syncs = policy_versions(client, keys.policy)
    assert syncs == [(0, 0), (1, 1), (2, 2), (3, 3)]  # the initial weights, then one per step
    stamps = [g.policy_version for g in published if g.rewards().std() > 0]
    assert stamps == [0, 0, 1, 1, 2, 2]  # later groups carry later versions
    events = _metrics(client, keys)
    assert [e.step for e in events] == [1, 2, 3]
    for e in events:
        assert set(e.values) == set(TRAIN)
        assert e.values["staleness_max"] == 0 and e.values["clip_fraction"] == 0
        assert e.values["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # the sampler ran our weights
    assert sum(e.values["groups_rejected_zero_variance"] for e in events) == 1
    chain = checkpoint.audit_chain(tmp_path / "data" / keys.run / "checkpoints")
    trained = collections.Counter(g for m in chain for g in m.group_ids)
    assert set(trained) == {g.group_id for g in published if g.rewards().std() > 0}
    assert max(trained.values()) == 1
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0
    assert len(list(weights_dir.iterdir())) <= 3  # keep_versions + the checkpointed one


@pytest.mark.slow
def test_sigterm_checkpoints_what_was_trained_and_exits_0(private_valkey, tmp_path):
    client = connect(private_valkey.url)
    keys = Keys("term")
    rng = random.Random(4)
    groups = [make_group(rng) for _ in range(4)]
    publish(client, keys.traj, groups)
    trainer = {"groups_per_step": 2, "steps": 0, "checkpoint_every": 100, "max_staleness": 10}
    config = trainer_config(tmp_path, keys.run, trainer=trainer)
    log = tmp_path / "trainer.log"
    proc = start_trainer(config, private_valkey.url, log)
    try:
        wait_until(
            lambda: client.xlen(keys.policy) == 3, timeout=START, what="two steps", watch=Watch(proc, log=log)
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    chain = checkpoint.audit_chain(tmp_path / "data" / keys.run / "checkpoints")
    assert [g for m in chain for g in m.group_ids] == [g.group_id for g in groups]
    assert chain[-1].step == 2 and chain[-1].version == 2
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0
    assert "SIGTERM" in log.read_text()


def test_trainer_section_validates():
    with pytest.raises(ConfigError, match="key `trainer.min_group_size`: must be >= 1"):
        replace(RunConfig(), trainer={"min_group_size": 0})  # what a CLI override goes through
    assert TrainerSection().micro_batch_size == 0
