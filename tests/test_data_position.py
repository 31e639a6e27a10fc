"""The dataset position (row cursor, rows handed out but not finished) in each trainer
checkpoint, and put back when the server lost it."""

from __future__ import annotations

import logging
import random
import threading

from trainer_data import make_group, publish

from consumers import checkpoint, trainer
from consumers.learner import Learner
from streamer import demo, position
from streamer.admission import Leases
from streamer.config import RunConfig, replace
from streamer.position import DataPosition


def _cfg(url, keys, tmp_path, steps: int) -> RunConfig:
    fields = {"groups_per_step": 2, "lr": 1e-3, "max_staleness": 100, "steps": steps}
    return replace(
        RunConfig(), run={"name": keys.run, "redis_url": url, "data_dir": str(tmp_path)}, trainer=fields
    )


def _train(cfg: RunConfig, client, keys) -> checkpoint.CheckpointMeta:
    learner = Learner(demo.build_model(cfg.run.seed), cfg.trainer)
    assert trainer.Trainer(cfg, client, keys, learner, stop=threading.Event()).run() == 0
    return checkpoint.latest(cfg.checkpoint_dir)[1]


def _lose_everything(client, keys) -> None:
    """The server restarted without persistence (only this run's keys: the server is shared)."""
    for key in client.scan_iter(match=keys.all_keys_pattern(), count=1000):
        client.delete(key)


def test_a_checkpoint_records_the_dataset_position_and_a_server_that_lost_it_gets_it_back(
    redis_url, keys, client, tmp_path, caplog
):
    rng = random.Random(3)
    client.set(keys.cursor, 13)  # epoch 1 of a 10-row dataset, 3 rows in
    client.rpush(keys.requeue, 3)  # handed back, not finished
    client.zadd(keys.leases, {"5": 4e9})  # being worked on
    publish(client, keys.traj, [make_group(rng) for _ in range(2)])
    meta = _train(_cfg(redis_url, keys, tmp_path, steps=1), client, keys)
    assert meta.data == DataPosition(cursor=13, open_tickets=[3, 5])

    _lose_everything(client, keys)
    client.set(keys.cursor, 1)  # a producer claimed ticket 0 on the emptied server before the trainer came
    publish(client, keys.traj, [make_group(rng) for _ in range(2)])
    with caplog.at_level(logging.WARNING, logger="consumers.trainer"):
        meta = _train(_cfg(redis_url, keys, tmp_path, steps=2), client, keys)
    assert "the server lost the dataset position: restored from" in caplog.text
    assert int(client.get(keys.cursor)) == 13 and client.lrange(keys.requeue, 0, -1) == [b"3", b"5"]
    leases = Leases(client, keys, owner="p", lease_seconds=30)
    assert [leases.claim() for _ in range(3)] == [3, 5, 13], "the open rows first, then on from the cursor"
    assert meta.data == DataPosition(cursor=13, open_tickets=[3, 5]), "the next checkpoint records it again"


def test_a_server_that_kept_its_position_is_left_alone(redis_url, keys, client):
    saved = DataPosition(cursor=13, open_tickets=[3])
    client.set(keys.cursor, 20)  # rows went on after the checkpoint: nothing was lost
    assert position.recover(client, keys, saved) is None
    assert int(client.get(keys.cursor)) == 20 and client.llen(keys.requeue) == 0
    assert position.recover(client, keys, DataPosition(cursor=0)) is None  # nothing was claimed yet
    assert position.recover(client, keys, None) is None  # a checkpoint from before positions were kept
