"""One trainer per run, held on the server: a second trainer with another data dir is refused,
a trainer whose run was taken over can neither acknowledge nor publish, and a trainer that
finds no checkpoint where the server records one does not start over from the initial weights.
"""

from __future__ import annotations

import random
import threading

import pytest
from bounds import START
from harness import report, run_config
from trainer_data import make_group, publish
from waits import wait_until

from consumers import checkpoint
from consumers.learner import Learner
from consumers.trainer import Trainer
from consumers.versions import VersionPublisher
from schemas import TrajectoryGroup
from streamer import demo
from streamer.admission import Admission
from streamer.bus import Consumer
from streamer.config import BusSection, RunConfig, replace
from streamer.connection import connect
from streamer.errors import StreamerError
from streamer.keys import TRAINER_GROUP, Keys
from streamer.trainer_lease import TrainerFenced, TrainerLease


def _cfg(url, keys, data_dir, **trainer) -> RunConfig:
    fields = {"groups_per_step": 2, "lr": 1e-3, "max_staleness": 100, "checkpoint_every": 1, **trainer}
    return replace(
        RunConfig(), run={"name": keys.run, "redis_url": url, "data_dir": str(data_dir)}, trainer=fields
    )


def _trainer(cfg: RunConfig, client, keys, **kw) -> Trainer:
    learner = Learner(demo.build_model(cfg.run.seed), cfg.trainer)
    return Trainer(cfg, client, keys, learner, stop=threading.Event(), **kw)


@pytest.mark.slow
def test_a_second_trainer_with_another_data_dir_is_refused_and_writes_nothing(
    private_valkey, procs, tmp_path
):
    url, keys = private_valkey.url, Keys("owned")
    client = connect(url)
    first = run_config(tmp_path / "first.toml", keys, tmp_path / "first")
    second = run_config(tmp_path / "second.toml", keys, tmp_path / "second")
    procs.start("first", "train", "--config", str(first), "--redis-url", url)
    wait_until(
        lambda: client.xlen(keys.policy) >= 1, timeout=START, what="the first trainer's v0", watch=procs
    )
    before = {"policy": client.xlen(keys.policy), "fence": client.get(keys.trainer_fence)}
    procs.start("second", "train", "--config", str(second), "--redis-url", url)
    # before the fix the second one announced its initial weights as the next version
    wait_until(
        lambda: procs.procs["second"].poll() is not None or client.xlen(keys.policy) > before["policy"],
        timeout=START,
        what="the second trainer to exit or to publish",
    )
    code = procs.procs["second"].poll()  # None: it runs on, training the run a second time
    log = procs.log("second")
    lines = [line for line in log.splitlines() if line.startswith("streamer train:")]
    report("second-trainer", exit=code, message=repr(lines[-1] if lines else ""))
    assert code == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert len(lines) == 1 and "being trained by another trainer" in lines[0], log[-3000:]
    assert f"data dir {tmp_path / 'first'}" in lines[0], lines  # names the holder
    assert client.xlen(keys.policy) == before["policy"] and client.get(keys.trainer_fence) == before["fence"]
    assert procs.procs["first"].poll() is None, procs.tails()
    assert procs.stop("first") == 0, procs.tails()
    # a clean stop gives the lease back: the same data dir starts again at once
    assert not client.exists(keys.trainer_lease)


def test_a_trainer_whose_run_was_taken_over_cannot_ack_or_publish(client, keys, redis_url, tmp_path):
    paused = TrainerLease(client, keys, owner="a", holder="trainer A", seconds=0.3)
    paused.acquire()
    ids = publish(client, keys.traj, [make_group(random.Random(i)) for i in range(3)])
    consumer = Consumer(
        client,
        keys,
        keys.traj,
        TRAINER_GROUP,
        "trainer-0",
        as_type=TrajectoryGroup,
        cfg=BusSection(),
        fence=paused,
    )
    assert [d.id for d in consumer.read(block=0.1)] == ids
    # paused past its lease; another trainer takes the run
    wait_until(lambda: not client.exists(keys.trainer_lease), timeout=10, what="the lease to lapse")
    TrainerLease(client, keys, owner="b", holder="trainer B").acquire()

    with pytest.raises(TrainerFenced):
        consumer.ack(ids[:1])
    admission = Admission(client, keys, max_staleness=0, groups_per_step=2, fence=paused)
    with pytest.raises(TrainerFenced):
        admission.reject([(ids[1], "stale")], group=TRAINER_GROUP)
    versions = VersionPublisher(
        client, keys, root=tmp_path / "weights", keep_versions=2, protect=lambda: -1, fence=paused
    )
    with pytest.raises(TrainerFenced):
        versions.publish_now(demo.build_model(0), version=1, step=1)
    versions.close()
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 3  # nothing acknowledged
    assert client.xlen(keys.policy) == 0 and client.get(keys.version) is None  # nothing announced
    assert not paused.renew() and paused.lost.is_set()

    # a whole trainer holding the stale fence stops at its first write, with one clear reason
    trainer = _trainer(_cfg(redis_url, keys, tmp_path / "a", steps=1), client, keys, lease=paused)
    with pytest.raises(TrainerFenced, match="another trainer took run"):
        trainer.run()
    assert client.xlen(keys.policy) == 0


def test_a_trainer_without_the_recorded_checkpoint_refuses_to_start_over(client, keys, redis_url, tmp_path):
    rng = random.Random(5)
    publish(client, keys.traj, [make_group(rng) for _ in range(2)])
    assert _trainer(_cfg(redis_url, keys, tmp_path / "first", steps=1), client, keys).run() == 0
    name = checkpoint.latest(tmp_path / "first" / keys.run / "checkpoints")[1].name
    policy = client.xlen(keys.policy)

    publish(client, keys.traj, [make_group(rng) for _ in range(2)])  # (before the fix it trained them)
    elsewhere = _cfg(redis_url, keys, tmp_path / "elsewhere", steps=1)
    with pytest.raises(StreamerError) as refused:
        _trainer(elsewhere, client, keys).run()
    message = str(refused.value)
    assert name in message and "holds no checkpoint" in message and "--from-initial-weights" in message
    assert "\n" not in message
    assert client.xlen(keys.policy) == policy  # nothing announced

    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0  # nothing read
    # told to, it trains this run on from the initial weights
    assert _trainer(elsewhere, client, keys, from_initial_weights=True).run() == 0
    assert client.xlen(keys.policy) == policy + 2
