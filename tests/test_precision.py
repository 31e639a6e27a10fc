"""Mixed precision on CPU: every accepted setting trains (finite weights that move), fp32 master weights."""

from __future__ import annotations

import math
import random

import pytest
import torch
from trainer_data import make_group

from consumers import precision
from consumers.batch import collate
from consumers.learner import Learner
from streamer import demo
from streamer.config import ConfigError, TrainerSection, parse_config


def _batch(model, seed=0):
    rng = random.Random(seed)
    return collate([make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(2)])


CASES = [  # (weights dtype the model was loaded in, trainer.precision, expected compute dtype)
    (torch.float32, "auto", torch.float32),
    (torch.float32, "float32", torch.float32),
    (torch.float32, "bfloat16", torch.bfloat16),
    (torch.float32, "float16", torch.float16),
    (torch.bfloat16, "auto", torch.bfloat16),
    (torch.float16, "auto", torch.float16),
]


@pytest.mark.parametrize(("loaded", "setting", "compute"), CASES)
def test_each_precision_trains_with_float32_master_weights(loaded, setting, compute):
    model = demo.build_model(0).to(loaded)
    batch = _batch(model)
    learner = Learner(model, TrainerSection(lr=1e-3, precision=setting, ppo_minibatches=2))
    assert learner.precision.dtype == compute
    assert (learner.precision.scaler is not None) == (compute == torch.float16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    metrics = [learner.train_step(batch) for _ in range(3)]
    assert all(math.isfinite(v) for m in metrics for v in m.values()), metrics
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    moved = sum(int((a != b).sum()) for a, b in zip(before, model.parameters()))
    total = sum(p.numel() for p in model.parameters())
    assert moved > total // 2, f"only {moved} of {total} weights moved"
    for state in learner.optimizer.state.values():
        assert state["exp_avg_sq"].dtype == torch.float32
    assert sum(m["optimizer_steps_skipped"] for m in metrics) == 0


@pytest.mark.parametrize("setting", ["float32", "float16"])
def test_a_non_finite_gradient_skips_the_step_and_is_counted(setting):
    model = demo.build_model(0)
    batch = _batch(model)
    learner = Learner(model, TrainerSection(lr=1e-3, precision=setting))
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = batch.replace(advantages=torch.full_like(batch.advantages, float("nan")))
    metrics = learner.train_step(poisoned)
    assert metrics["optimizer_steps_skipped"] == 1.0 and learner.precision.skipped == 1
    assert learner.step == 0, "a step that changed no weights is no step"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (
        "a skipped step changed weights"
    )
    assert not learner.optimizer.state or all(
        bool(torch.isfinite(s["exp_avg"]).all()) for s in learner.optimizer.state.values()
    )
    after = learner.train_step(batch)  # and training goes on
    assert after["optimizer_steps_skipped"] == 0.0 and learner.step == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_precision_settings_are_checked():
    with pytest.raises(ConfigError, match="trainer.precision"):
        parse_config(b'[trainer]\nprecision = "int8"\n')
    with pytest.raises(ConfigError, match="trainer.precision"):
        precision.compute_dtype("fp8", device=torch.device("cpu"), loaded=torch.float32)
    auto = precision.compute_dtype("auto", device=torch.device("cpu"), loaded=torch.float32)
    assert auto == torch.float32
