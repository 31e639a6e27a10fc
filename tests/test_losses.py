"""The loss family and the advantage functions against values computed by hand (value and gradient)."""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch
from trainer_data import loss_on, make_group

from consumers import advantages as A
from consumers import losses
from consumers.batch import collate, collator
from consumers.learner import Learner
from streamer import demo
from streamer.config import ConfigError, TrainerSection, parse_config
from streamer.config_trainer import LOSS_KEYS


def _grad(loss, logp) -> list:
    loss.backward()
    return logp.grad.tolist()


def _approx(expected):
    return pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_dapo_dual_clip_bounds_negative_advantages():
    logp = torch.tensor([[0.5, 1.0, 4.0]]).log().requires_grad_()
    loss, stats = loss_on("dapo", logp, adv=[-1.0], tis_cap=5.0, eps_low=0.2, eps_high=0.28, eps_clip_c=3.0)
    # A < 0: max(r, clip(r)) per token = [0.8 (low clip), 1.0, 4.0 -> dual clip c = 3]
    assert loss.item() == _approx((0.8 + 1.0 + 3.0) / 3)
    assert _grad(loss, logp) == [_approx([0.0, 1 / 3, 0.0])]  # plain GRPO would give 4/3 on the last
    assert float(stats["clip_low_fraction"]) == _approx(1 / 3)
    assert float(stats["clip_high_fraction"]) == _approx(1 / 3)


def test_dapo_clip_higher_is_asymmetric():
    logp = torch.tensor([[0.5, 1.0, 1.3]]).log().requires_grad_()
    loss, stats = loss_on("dapo", logp, adv=[1.0], tis_cap=5.0, eps_low=0.2, eps_high=0.28, eps_clip_c=3.0)
    assert loss.item() == _approx(-(0.5 + 1.0 + 1.28) / 3)  # 1.3 clipped at 1.28, 0.5 not at 0.8
    assert _grad(loss, logp) == [_approx([-0.5 / 3, -1 / 3, 0.0])]
    assert float(stats["clip_high_fraction"]) == _approx(1 / 3) and float(stats["clip_low_fraction"]) == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_gspo_uses_one_ratio_per_sequence(agg):
    logp = torch.tensor([[1.2, 0.8], [2.0, 1.0]]).log().requires_grad_()
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = loss_on(
        "gspo", logp, adv=[1.0, 1.0], weights=weights, agg=agg, tis_cap=5.0, eps_low=0.5, eps_high=0.5
    )
    s = math.sqrt(1.2 * 0.8)  # geometric mean of the token ratios of sequence 0
    # sequence 1's ratio 2 is clipped at 1.5 as a whole: no gradient
    if agg == "token-mean":
        assert loss.item() == _approx(-(2 * s + 1.5) / 3)
        assert _grad(loss, logp) == [_approx([-s / 3, -s / 3]), _approx([0.0, 0.0])]
    else:
        assert loss.item() == _approx(-(s + 1.5) / 2)
        assert _grad(loss, logp) == [_approx([-s / 4, -s / 4]), _approx([0.0, 0.0])]
    assert float(stats["ratio_mean"]) == _approx((2 * s + 2.0) / 3)
    assert float(stats["clip_high_fraction"]) == _approx(1 / 3)


def test_cispo_clips_the_weight_not_the_gradient():
    r = torch.tensor([[0.5, 1.0, 6.0]])
    logp = r.log().requires_grad_()
    loss, stats = loss_on("cispo", logp, adv=[2.0], tis_cap=5.0, eps_low=1.0, eps_high=4.0)
    clipped = [0.5, 1.0, 5.0]  # the weight is capped at 1 + 4; every token keeps a gradient
    value = -sum(c * 2.0 * math.log(x) for c, x in zip(clipped, r[0].tolist())) / 3
    assert loss.item() == _approx(value)
    assert _grad(loss, logp) == [_approx([-c * 2.0 / 3 for c in clipped])]
    assert float(stats["clip_high_fraction"]) == _approx(1 / 3)


def test_reinforce_weights_by_the_truncated_importance_weight():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = logp.detach().clone()
    sampler = prox - torch.tensor([[0.0, math.log(2.0)]])  # w = [1, 2]
    loss, _ = loss_on("reinforce", logp, adv=[1.5], prox=prox, sampler=sampler, tis_cap=5.0)
    assert loss.item() == _approx((1.5 * 1.0 + 2 * 1.5 * 2.0) / 2)  # -w A logp
    assert _grad(loss, logp) == [_approx([-1.5 / 2, -3.0 / 2])]


def test_importance_sampling_against_the_sampler():
    logp = torch.tensor([[0.0, math.log(2.0)]], requires_grad=True)
    sampler = torch.tensor([[math.log(2.0), 0.0]])  # ratios to the sampler: 0.5 and 2
    loss, _ = loss_on("importance_sampling", logp, adv=[1.0], prox=logp.detach(), sampler=sampler)
    assert loss.item() == _approx(-(0.5 + 2.0) / 2)
    assert _grad(loss, logp) == [_approx([-0.25, -1.0])]


def test_dro_penalises_the_distance_to_the_sampler():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.0]])  # the first token moved by +0.5 since it was sampled
    loss, stats = loss_on("dro", logp, adv=[2.0], prox=logp.detach(), sampler=sampler, beta=0.5)
    # pg = -(A logp - beta/2 (logp - sampler)^2), token-mean over 2 tokens
    assert loss.item() == _approx((-(2.0 * -1.0 - 0.25 * 0.25) - 2.0 * -2.0) / 2)
    assert _grad(loss, logp) == [_approx([(-2.0 + 0.5 * 0.5) / 2, -2.0 / 2])]
    assert float(stats["clip_fraction"]) == 0.0


def halved_reinforce(*, logp, prox_logp, sampler_logp, advantages, weights):
    """A loss of one's own for the tests: half of plain REINFORCE, as a (B, T) tensor."""
    return -0.5 * advantages.unsqueeze(-1) * logp


def test_a_loss_of_ones_own_by_import_path():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = loss_on("test_losses:halved_reinforce", logp, adv=[2.0], prox=logp.detach())
    assert loss.item() == _approx(-0.5 * 2.0 * (-3.0) / 2)
    assert _grad(loss, logp) == [_approx([-0.5, -0.5])]
    assert float(stats["ratio_mean"]) == _approx(1.0)
    cfg = parse_config(b'[trainer]\nloss = "test_losses:halved_reinforce"\n').trainer
    assert losses.params_of(cfg.loss, cfg) == {} and cfg.aggregation == "token-mean"
    with pytest.raises(ConfigError, match=r"`trainer.loss` 'test_losses:nothing'"):
        losses.params_of("test_losses:nothing", cfg)
    with pytest.raises(ConfigError, match=r"trainer.loss.*module:function"):
        parse_config(b'[trainer]\nloss = "dr0"\n')


def test_loss_of_ones_own_with_a_wrong_shape_is_a_clear_error():
    logp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"returned \(1,\); expected Terms or a \(1, 2\) tensor"):
        loss_on("test_losses:summed_loss", logp, adv=[1.0])


def summed_loss(*, logp, prox_logp, sampler_logp, advantages, weights):
    return logp.sum(-1)


def test_gspo_aggregates_by_sequence_unless_told_otherwise():
    assert TrainerSection(loss="gspo").aggregation == "seq-mean"
    assert TrainerSection(loss="gspo", loss_agg="token-mean").aggregation == "token-mean"
    assert TrainerSection(loss="grpo").aggregation == "token-mean"
    assert TrainerSection(loss="dro", loss_agg="seq-mean").aggregation == "seq-mean"


def test_gspo_learner_weighs_sequences_equally_by_default():
    """Under the default loss_agg, a long and a short sequence with opposite advantages pull
    equally: the step's policy loss is the sequence mean, not the token mean."""
    model = demo.build_model(0)
    rng = random.Random(3)
    batch = collate([make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0))])
    stats = {}
    for agg in ("auto", "seq-mean", "token-mean"):
        fresh = demo.build_model(0)
        learner = Learner(fresh, TrainerSection(lr=1e-3, loss="gspo", loss_agg=agg))
        stats[agg] = learner.train_step(batch)["policy_loss"]
    assert stats["auto"] == pytest.approx(stats["seq-mean"], abs=1e-7)
    assert stats["auto"] != pytest.approx(stats["token-mean"], abs=1e-4)  # the lengths differ


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo", "reinforce", "dro"])
def test_every_loss_is_plain_grpo_on_policy(name):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    params = losses.params_of(name, TrainerSection())
    loss, stats = loss_on(name, logp, adv=[1.5, -0.5], prox=logp.detach(), weights=weights, **params)
    assert _grad(loss, logp) == [_approx([-0.5, -0.5]), _approx([0.5 / 3, 0.0])]
    assert float(stats["ppo_kl"]) == 0.0 and float(stats["mismatch_kl"]) == 0.0
    assert float(stats["ratio_mean"]) == _approx(1.0)


def test_mismatch_and_ppo_kl_are_k3():
    logp = torch.zeros(1, 2)
    prox = torch.tensor([[math.log(2.0), 0.0]])
    sampler = torch.zeros(1, 2)
    _, stats = loss_on(
        "grpo", logp, adv=[1.0], prox=prox, sampler=sampler, tis_cap=5.0, eps_low=0.2, eps_high=0.2
    )
    k3 = (2 - math.log(2) - 1) / 2  # one token with log ratio ln 2, one with 0
    assert float(stats["mismatch_kl"]) == _approx(k3)
    assert float(stats["ppo_kl"]) == _approx((0.5 + math.log(2) - 1) / 2)


def test_loss_table_matches_the_functions():
    tensors = {"logp", "prox_logp", "sampler_logp", "advantages", "weights"}
    assert set(losses.LOSSES) == set(LOSS_KEYS)
    for name, fn in losses.LOSSES.items():
        args = set(inspect.signature(fn).parameters) - tensors
        assert args == {k.rpartition(".")[2] for k in LOSS_KEYS[name]}, name
        assert "pg_t" in fn.__doc__, f"{name} has no formula in its docstring"
    cfg = parse_config(b'[trainer]\nloss = "dapo"\n[trainer.dapo]\neps_clip_c = 2.5\n').trainer
    assert losses.params_of("dapo", cfg) == {
        "tis_cap": 5.0,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "eps_clip_c": 2.5,
    }
    with pytest.raises(ConfigError, match=r"trainer.dapo.eps_clip_c"):
        parse_config(b"[trainer.dapo]\neps_clip_c = 1.0\n")
    with pytest.raises(ConfigError, match=r"trainer.loss"):
        parse_config(b'[trainer]\nloss = "ppo2"\n')


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert A.dr_grpo(r).tolist() == _approx([0.5, -0.5, -0.5, 0.5])
    assert A.rloo(r).tolist() == _approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])  # r_i - mean of the others
    grpo = A.resolve(TrainerSection(advantage="grpo"))
    assert grpo(r).tolist() == _approx([1, -1, -1, 1])
    user = A.resolve(TrainerSection(advantage="test_losses:halved"))
    assert A.min_group_size_of(user) == 1
    assert A.compute(user, r).tolist() == _approx([0.5, 0.0, 0.0, 0.5])
    with pytest.raises(ConfigError, match="trainer.advantage"):
        A.resolve(TrainerSection(advantage="nowhere_module:fn"))
    with pytest.raises(ConfigError, match="trainer.advantage"):
        parse_config(b'[trainer]\nadvantage = "ppo"\n')


def halved(rewards):
    """A user advantage function for the test above: works on one sample."""
    return rewards / 2


halved.min_group_size = 1


def test_collator_uses_the_configured_advantage():
    rng = random.Random(0)
    group = make_group(rng, rewards=(1.0, 0.0, 0.0, 1.0))
    batch = collator(TrainerSection(advantage="rloo"))([group])
    assert batch.advantages.tolist() == _approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert collate([group]).advantages.tolist() == _approx([1, -1, -1, 1])


@pytest.mark.parametrize("name", [*sorted(LOSS_KEYS), "test_losses:halved_reinforce"])
def test_each_loss_trains_the_demo_model(name):
    model = demo.build_model(0)
    rng = random.Random(1)
    batch = collate([make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(2)])
    learner = Learner(model, TrainerSection(lr=1e-2, loss=name, loss_agg="seq-mean", ppo_minibatches=2))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = [learner.train_step(batch) for _ in range(2)]
    assert all(math.isfinite(v) for m in metrics for v in m.values()), metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_reports_its_diagnostics():
    model, ref = demo.build_model(0), demo.build_model(0)
    rng = random.Random(2)
    batch = collate([make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(2)])
    learner = Learner(model, TrainerSection(lr=1e-2, kl_coef=0.1, ppo_minibatches=2), ref_model=ref)
    m = learner.train_step(batch)
    for phase in ("proximal_forward_seconds", "reference_forward_seconds", "forward_backward_seconds"):
        assert m[phase] > 0, phase
    assert m["optimizer_seconds"] >= 0
    assert m["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)  # the batch's log-probs are this model's
    assert m["ppo_kl"] > 0 and m["ratio_mean"] != 1.0  # the second minibatch saw moved weights
    assert 0 <= m["clip_low_fraction"] + m["clip_high_fraction"] == pytest.approx(m["clip_fraction"])
