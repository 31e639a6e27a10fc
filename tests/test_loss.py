"""The objective against hand-computed values on tiny tensors, and on the demo model."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from trainer_data import loss_on, make_group

from consumers import losses
from consumers.advantages import group_advantages
from consumers.batch import collate
from consumers.learner import Learner
from streamer import demo
from streamer.config import TrainerSection

EPS = dict(eps_low=0.2, eps_high=0.2, tis_cap=5.0)


def _close(t: torch.Tensor, expected) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-5, atol=1e-6)


def _loss(logp, **kw):
    return loss_on("grpo", logp, **{**EPS, **kw})


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert group_advantages(r).tolist() == pytest.approx([1, -1, -1, 1], abs=1e-4)
    assert group_advantages(r, std_normalize=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]
    # std 0.01 floored to 0.1: (0.02 - 0.01) / 0.1
    assert group_advantages(torch.tensor([0.0, 0.02]), std_floor=0.1).tolist() == pytest.approx([-0.1, 0.1])


def test_clipping_positive_advantage():
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5]])
    logp = ratios.log().requires_grad_()
    loss, stats = _loss(logp, adv=[1.0])
    # min(r, clip(r, .8, 1.2)) = [.5, .9, 1.1, 1.2]: only the high side binds for A > 0
    assert loss.item() == pytest.approx(-(0.5 + 0.9 + 1.1 + 1.2) / 4)
    assert float(stats["clip_fraction"]) == pytest.approx(0.25)
    loss.backward()
    # d/dlogp of -r/4 is -r/4; the clipped token has no gradient
    _close(logp.grad, [[-0.5 / 4, -0.9 / 4, -1.1 / 4, 0.0]])


def test_clipping_negative_advantage():
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5]])
    logp = ratios.log().requires_grad_()
    loss, stats = _loss(logp, adv=[-1.0])
    # min(-r, -clip(r)) = [-.8, -.9, -1.1, -1.5]: only the low side binds for A < 0
    assert loss.item() == pytest.approx((0.8 + 0.9 + 1.1 + 1.5) / 4)
    assert float(stats["clip_fraction"]) == pytest.approx(0.25)
    loss.backward()
    _close(logp.grad, [[0.0, 0.9 / 4, 1.1 / 4, 1.5 / 4]])


def test_asymmetric_clip_bounds():
    logp = torch.tensor([[0.85, 1.25, 1.35]]).log()
    up, _ = _loss(logp, adv=[1.0], eps_low=0.1, eps_high=0.3)  # 1.25 inside, 1.35 -> 1.3
    assert up.item() == pytest.approx(-(0.85 + 1.25 + 1.3) / 3)
    down, _ = _loss(logp, adv=[-1.0], eps_low=0.1, eps_high=0.3)  # 0.85 -> 0.9
    assert down.item() == pytest.approx((0.9 + 1.25 + 1.35) / 3)


def test_truncated_importance_weight():
    prox = torch.zeros(1, 2)
    sampler = torch.tensor([[-math.log(10.0), math.log(2.0)]])  # raw weights 10 and 0.5
    logp = prox.clone().requires_grad_()
    loss, stats = _loss(logp, adv=[1.0], prox=prox, sampler=sampler, tis_cap=5.0)
    assert loss.item() == pytest.approx(-(5.0 + 0.5) / 2)
    assert float(stats["is_weight_max"]) == pytest.approx(10.0, rel=1e-5)
    assert float(stats["is_weight_mean"]) == pytest.approx(2.75)
    loss.backward()
    _close(logp.grad, [[-5.0 / 2, -0.5 / 2]])  # the weight is a constant


def test_prompt_tokens_are_masked():
    rng = random.Random(0)
    batch = collate([make_group(rng)], std_normalize=False)
    w, adv = batch.weights, batch.advantages.tolist()
    assert bool((w[:, : batch.input_ids.shape[1] // 2] == 0).all())  # prompts are longer than half
    logp = torch.full_like(w, -1.0)
    base, _ = _loss(logp, adv=adv, weights=w, prox=logp, sampler=logp)
    wild = torch.where(w > 0, logp, torch.full_like(w, 7.0))  # garbage off the completions
    other, _ = _loss(wild, adv=adv, weights=w, prox=wild, sampler=torch.where(w > 0, logp, -wild))
    assert base.item() == other.item()
    logp = logp.clone().requires_grad_()
    loss, _ = _loss(logp, adv=adv, weights=w, prox=logp.detach(), sampler=logp.detach())
    loss.backward()
    assert bool((logp.grad[w == 0] == 0).all())
    assert bool((logp.grad[w > 0] != 0).all())


def test_aggregation_modes():
    # seq 0: one token, A=2 -> -2 per token; seq 1: three tokens, A=-1 -> +1 per token
    weights = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    logp = torch.zeros(2, 3)
    tok, _ = _loss(logp, adv=[2.0, -1.0], weights=weights, agg="token-mean")
    seq, _ = _loss(logp, adv=[2.0, -1.0], weights=weights, agg="seq-mean")
    assert tok.item() == pytest.approx((-2 + 3) / 4)
    assert seq.item() == pytest.approx((-2 + 1) / 2)
    # micro-batches with the minibatch's denominator sum to the whole
    for agg in ("token-mean", "seq-mean"):
        denom = losses.normalizer(weights, agg)
        parts = [
            _loss(logp[i : i + 1], adv=[a], weights=weights[i : i + 1], agg=agg, denom=denom)[0]
            for i, a in enumerate([2.0, -1.0])
        ]
        whole = _loss(logp, adv=[2.0, -1.0], weights=weights, agg=agg)[0]
        assert sum(parts).item() == pytest.approx(whole.item())


def test_k3_kl():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), 0.0]])
    loss, stats = _loss(logp, adv=[0.0], kl_coef=0.5, ref_logp=ref)
    kl = (2 - math.log(2) - 1 + 0.0) / 2  # k3 per token, token-mean
    assert float(stats["kl"]) == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 * kl)
    with pytest.raises(ValueError):
        _loss(logp, adv=[0.0], kl_coef=0.5)


def test_on_policy_reduces_to_grpo_on_tensors():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    weights = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = [1.5, -0.5]
    loss, stats = _loss(logp, adv=adv, prox=logp.detach(), sampler=logp.detach(), weights=weights)
    # ratio 1, IS weight 1: loss = -sum(A w) / N, gradient -A / N on trained tokens
    assert loss.item() == pytest.approx(-(1.5 + 1.5 - 0.5) / 3)
    loss.backward()
    _close(logp.grad, [[-0.5, -0.5], [0.5 / 3, 0.0]])
    assert float(stats["clip_fraction"]) == 0.0


def _fixed_batch(model, seed=0, groups=3):
    rng = random.Random(seed)
    gs = [make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(groups)]
    return collate(gs)


def test_one_minibatch_step_is_plain_grpo():
    """max_staleness=0, one minibatch: the learner's gradient == a hand-written GRPO gradient."""
    cfg = TrainerSection(lr=1e-2, ppo_minibatches=1, max_staleness=0, grad_clip=1.0, weight_decay=0.01)
    model = demo.build_model(0)
    reference = copy.deepcopy(model)
    learner = Learner(model, cfg)
    batch = _fixed_batch(model)
    prox = learner.prepare(batch)[0].prox_logp
    batch = batch.replace(sampler_logp=prox * (batch.weights > 0))  # sampled by these very weights
    metrics = learner.train_step(batch)

    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = losses.token_logprobs(logits, batch.targets)
    grpo = -(batch.advantages[:, None] * logp * batch.weights).sum() / batch.weights.sum()
    grpo.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    expected = -(batch.advantages[:, None] * batch.weights).sum() / batch.weights.sum()  # ratio 1, weight 1
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert metrics["clip_fraction"] == 0.0 and metrics["is_weight_mean"] == pytest.approx(1.0)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_steps_on_a_fixed_batch_lower_the_loss(agg):
    model = demo.build_model(1)
    batch = _fixed_batch(model, seed=1)
    cfg = TrainerSection(lr=3e-3, ppo_minibatches=2, loss_agg=agg, eps_low=0.2, eps_high=0.2)
    learner = Learner(model, cfg)

    objective = losses.Objective.of(cfg)

    def surrogate():  # the PPO loss of the current weights against the batch's sampler policy
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            logp = losses.token_logprobs(logits, batch.targets)
            loss, _ = objective(logp, batch.replace(prox_logp=batch.sampler_logp))
        return loss.item()

    before = surrogate()
    metrics = [learner.train_step(batch) for _ in range(4)]
    after = surrogate()
    assert after < before - 0.05, (before, after)
    assert learner.step == 4
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # fresh data: prox == sampler
    for m in metrics:
        names = {"loss", "policy_loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "tokens"}
        assert names <= m.keys()
        assert all(math.isfinite(v) for v in m.values())


def test_warmup_lr():
    learner = Learner(demo.build_model(0), TrainerSection(lr=1e-3, warmup_steps=4))
    assert [learner.lr_at(s) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def _grads_after_step(cfg: TrainerSection, batch, seed: int = 0) -> tuple[dict, dict]:
    learner = Learner(demo.build_model(seed), cfg)
    metrics = learner.train_step(batch)
    return {n: p.grad.clone() for n, p in learner.model.named_parameters()}, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_micro_batches_and_checkpointing_do_not_change_the_gradient(agg):
    batch = _fixed_batch(demo.build_model(0), seed=4, groups=3)  # 12 rows
    base_cfg = TrainerSection(lr=1e-3, loss_agg=agg, ppo_minibatches=1)
    base, m0 = _grads_after_step(base_cfg, batch)
    for variant in ({"micro_batch_size": 5}, {"gradient_checkpointing": True}):
        grads, m = _grads_after_step(
            TrainerSection(lr=1e-3, loss_agg=agg, ppo_minibatches=1, **variant), batch
        )
        assert m["loss"] == pytest.approx(m0["loss"], abs=1e-6), variant
        for name, g in base.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=f"{variant} {name}")


def test_kl_to_a_frozen_reference():
    model, ref = demo.build_model(0), demo.build_model(0)
    batch = _fixed_batch(model, seed=5)
    learner = Learner(model, TrainerSection(lr=1e-2, kl_coef=0.1), ref_model=ref)
    first = learner.train_step(batch)
    later = [learner.train_step(batch) for _ in range(3)]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert later[-1]["kl"] > 1e-5
    assert later[-1]["loss"] == pytest.approx(later[-1]["policy_loss"] + 0.1 * later[-1]["kl"], abs=1e-6)
    assert not any(p.requires_grad for p in ref.parameters())
    with pytest.raises(ValueError):
        Learner(demo.build_model(0), TrainerSection(kl_coef=0.1))


@pytest.mark.parametrize("variant", [{}, {"micro_batch_tokens": 40}, {"kl_coef": 0.1}])
def test_the_first_minibatch_s_update_forward_is_its_proximal_policy(variant):
    """Its update's own forward, detached, stands for the proximal pass: the same weights and
    the same metrics as with the pass (entropy included), one forward fewer."""
    batch = _fixed_batch(demo.build_model(0), seed=6, groups=4)
    cfg = TrainerSection(lr=1e-2, ppo_minibatches=2, **variant)
    runs = {}
    for reuse in (True, False):
        model = demo.build_model(0)
        learner = Learner(model, cfg, ref_model=demo.build_model(0) if cfg.kl_coef else None)
        assert learner.prox_from_update
        learner.prox_from_update = reuse
        metrics = [learner.train_step(batch) for _ in range(2)]
        runs[reuse] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters()})
    (reused, w_reused), (passed, w_passed) = runs[True], runs[False]
    for name, w in w_passed.items():
        torch.testing.assert_close(w_reused[name], w, rtol=1e-4, atol=1e-6, msg=name)
    timing = {k for k in reused[0] if k.endswith("_seconds")}
    for a, b in zip(reused, passed):
        assert set(a) == set(b)
        for k in set(a) - timing:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
        assert a["ratio_mean"] != 1.0  # the second minibatch still saw moved weights


def test_a_model_with_dropout_in_training_keeps_the_proximal_pass():
    from streamer import lora
    from streamer.config import LoraSection

    plain = Learner(demo.build_model(0), TrainerSection())
    dropped = Learner(lora.apply(demo.build_model(0), LoraSection(rank=4, dropout=0.1)), TrainerSection())
    assert plain.prox_from_update and not dropped.prox_from_update


def test_the_optimizer_updates_all_tensors_at_once_with_torch_s_per_tensor_results():
    """AdamW over every tensor in one op (foreach) gives the weights the per-tensor loop does."""
    batch = _fixed_batch(demo.build_model(0), seed=7, groups=4)
    weights = {}
    for foreach in (True, False):
        model = demo.build_model(0)
        learner = Learner(model, TrainerSection(lr=1e-2, ppo_minibatches=2, weight_decay=0.1))
        assert learner.optimizer.defaults["foreach"] is True
        for group in learner.optimizer.param_groups:
            group["foreach"] = foreach
        for _ in range(3):
            learner.train_step(batch)
        weights[foreach] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name
