"""The GRPO/PPO objective as pure tensor functions (no model, no I/O), testable by hand.

Per trained token t of sample i, with group advantage A_i:

    ratio_t  = exp(clamp(logp_t - prox_t, ±20))                 policy vs proximal policy
    w_t      = min(exp(prox_t - sampler_t), tis_cap)            truncated importance weight
    pg_t     = -w_t * min(ratio_t * A_i, clip(ratio_t, 1-eps_low, 1+eps_high) * A_i)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       k3 estimator (kl_coef > 0)
    loss     = agg(pg_t + kl_coef * kl_t)                        token-mean or seq-mean

``prox`` is the trainer's own log-prob of the batch recomputed once before the updates
(the decoupled-PPO proximal policy): the clip bounds how far one step moves from the
current weights, while ``w`` corrects for the sampler's (older, or numerically different)
policy. With fresh data and one minibatch ``logp == prox``, the ratio is 1 and the
gradient is plain on-policy GRPO: ``-w * A * grad(logp)``.

Shapes: (B, T) per-token tensors aligned to next-token targets, (B,) advantages.
"""

from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token-mean", "seq-mean"]
LOG_RATIO_CLAMP = 20.0


def group_advantages(
    rewards: torch.Tensor, *, std_normalize: bool = True, std_floor: float = 1e-4
) -> torch.Tensor:
    """(G,) rewards of one group -> (G,) advantages: reward - mean, over max(std, floor).

    The std is the population std (a group of one has advantage 0, not NaN).
    """
    rewards = rewards.double()  # float32 sums of large rewards overflow to inf (NaN advantages)
    centered = rewards - rewards.mean()
    if not std_normalize:
        return centered.float()
    return (centered / rewards.std(unbiased=False).clamp_min(std_floor)).float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-prob of each target."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - logits.logsumexp(-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropy of the next-token distribution (a metric only)."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def normalizer(weights: torch.Tensor, agg: Agg) -> torch.Tensor:
    """The denominator of ``agg`` over a whole minibatch (shared by its micro-batches)."""
    if agg == "token-mean":
        return weights.sum().clamp_min(1e-8)
    if agg == "seq-mean":
        return (weights.sum(-1) > 0).sum().clamp_min(1).float()
    raise ValueError(f"unknown loss aggregation {agg!r}")


def aggregate(
    values: torch.Tensor, weights: torch.Tensor, agg: Agg, denom: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted mean of (B, T) ``values``: over all tokens, or per sequence then over sequences.

    ``denom`` (from :func:`normalizer` of the whole minibatch) lets micro-batches sum to
    the minibatch's loss; by default it is computed from ``weights``.
    """
    denom = normalizer(weights, agg) if denom is None else denom
    if agg == "token-mean":
        return (values * weights).sum() / denom
    per_seq = (values * weights).sum(-1) / weights.sum(-1).clamp_min(1e-8)  # (B,)
    return per_seq.sum() / denom


def ppo_loss(
    *,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    agg: Agg = "token-mean",
    denom: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (with grad through ``logp`` only) and detached statistics of it.

    ``weights`` is 0 on prompt and padding positions and on masked completion tokens.
    Statistics: policy_loss and kl (aggregated like the loss), clip_fraction (trained
    tokens whose clipped term was the active one), is_weight_mean (after truncation),
    is_weight_max (before truncation).
    """
    prox_logp, sampler_logp = prox_logp.detach(), sampler_logp.detach()
    adv = advantages.detach().float().unsqueeze(-1)  # (B, 1)
    log_ratio = (logp - prox_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    raw_is = (prox_logp - sampler_logp).clamp(max=LOG_RATIO_CLAMP).exp()
    is_w = raw_is.clamp(max=tis_cap)
    pg = -is_w * torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    policy_loss = aggregate(pg, weights, agg, denom)
    total = policy_loss
    kl = torch.zeros((), device=logp.device)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        d = (ref_logp.detach() - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = aggregate(d.exp() - d - 1.0, weights, agg, denom)
        total = total + kl_coef * kl
    with torch.no_grad():
        trained = weights > 0
        n = trained.sum().clamp_min(1)
        was_clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "clip_fraction": (was_clipped & trained).sum() / n,
            "is_weight_mean": (is_w * trained).sum() / n,
            "is_weight_max": raw_is.masked_fill(~trained, 0.0).max(),
        }
    return total, stats
