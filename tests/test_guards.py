"""Guards (max_seq_len, group size vs advantage) and the LR schedule in optimizer steps."""

from __future__ import annotations

import math
import random

import pytest
from trainer_data import make_group

from consumers import advantages, schedule
from consumers.batch import collate
from consumers.filters import GroupFilter
from consumers.learner import Learner
from schemas.metric_names import REJECT_REASONS, TRAIN
from streamer import demo
from streamer.config import ConfigError, TrainerSection, parse_config


def _lrs(**kw) -> list[float]:
    cfg = TrainerSection(lr=1.0, **kw)
    return [schedule.lr_at(cfg, s) for s in range(6)]


def test_schedules_by_hand():
    assert _lrs(warmup_steps=2) == pytest.approx([0.5, 1, 1, 1, 1, 1])
    # warmup 2, decay over optimizer steps 2..6 (lr_decay_steps = 6): p = 0, .25, .5, .75
    assert _lrs(warmup_steps=2, lr_schedule="linear", lr_decay_steps=6) == pytest.approx(
        [0.5, 1, 1, 0.75, 0.5, 0.25]
    )
    cos = [(1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75)]
    assert _lrs(warmup_steps=2, lr_schedule="cosine", lr_decay_steps=6) == pytest.approx([0.5, 1, *cos])
    # the floor, and the decay length from steps * ppo_minibatches
    floored = _lrs(lr_schedule="linear", steps=2, ppo_minibatches=2, min_lr_ratio=0.2)
    assert floored == pytest.approx([1, 0.8, 0.6, 0.4, 0.2, 0.2])
    with pytest.raises(ConfigError, match="trainer.lr_schedule"):
        parse_config(b'[trainer]\nlr_schedule = "cosine"\n')


def test_the_schedule_counts_optimizer_steps():
    model = demo.build_model(0)
    rng = random.Random(0)
    batch = collate([make_group(rng, model=model) for _ in range(2)])
    cfg = TrainerSection(lr=1.0e-3, warmup_steps=4, ppo_minibatches=2)
    learner = Learner(model, cfg)
    lrs = [learner.train_step(batch)["lr"] for _ in range(3)]
    # trainer steps 0, 1, 2 end with optimizer steps 1, 3, 5
    assert lrs == pytest.approx([0.5e-3, 1.0e-3, 1.0e-3])


def test_a_group_over_max_seq_len_is_rejected_and_counted():
    rng = random.Random(0)
    group = make_group(rng)
    longest = max(s.num_tokens for s in group.samples)
    assert "too_long" in REJECT_REASONS and "groups_rejected_too_long" in TRAIN
    tight = GroupFilter.from_config(TrainerSection(max_seq_len=longest - 1))
    assert tight(group, version=0).reason == "too_long"
    assert GroupFilter.from_config(TrainerSection(max_seq_len=longest))(group, version=0).accepted
    assert GroupFilter.from_config(TrainerSection())(group, version=0).accepted  # 0 = no limit


def test_group_size_must_suit_the_advantage():
    with pytest.raises(ConfigError, match="producer.group_size"):
        parse_config(b"[producer]\ngroup_size = 1\nmin_group_size = 1\n")
    with pytest.raises(ConfigError, match="trainer.min_group_size"):
        parse_config(b'[trainer]\nmin_group_size = 1\nadvantage = "rloo"\n')
    one = b'[producer]\ngroup_size = 1\nmin_group_size = 1\n[trainer]\nmin_group_size = 1\nadvantage = "test_losses:halved"\n'
    cfg = parse_config(one)  # a user function may work on one sample: checked when the trainer starts
    fn = advantages.resolve(cfg.trainer)
    advantages.check_group_size(fn, group_size=1, min_group_size=1)
    with pytest.raises(ConfigError, match="trainer.advantage"):
        advantages.check_group_size(lambda r: r, group_size=1, min_group_size=1)
    single = make_group(random.Random(0), rewards=(1.0,))
    assert GroupFilter(max_staleness=0, min_group_size=1)(single, version=0).accepted
