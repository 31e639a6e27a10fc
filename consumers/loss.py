"""The GRPO/PPO objective as pure tensor functions (no model, no I/O), testable by hand.

Per trained token t of sample i, with group advantage A_i:

    ratio_t  = exp(clamp(logp_t - prox_t, ±20))                 policy vs proximal policy
    w_t      = min(exp(prox_t - sampler_t), tis_cap)            truncated importance weight
    pg_t     = -w_t * min(ratio_t * A_i, clip(ratio_t, 1-eps_low, 1+eps_high) * A_i)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       k3 estimator (kl_coef > 0)
    loss     = agg(pg_t + kl_coef * kl_t)                        token-mean or seq-mean

``pg_t`` above is the default ``grpo`` term; ``trainer.loss`` picks another from the family
in consumers/losses.py (dapo, gspo, cispo, reinforce, importance_sampling, dro, or one of
one's own), aggregated here the same way (``trainer.loss_agg = "auto"``: seq-mean for gspo,
whose objective is a mean over sequences, token-mean otherwise). The two aggregations, with
m_it = 1 on trained tokens (weight > 0):

    token-mean = sum_i sum_t m_it x_it / sum_i sum_t m_it
    seq-mean   = sum_i [sum_t m_it x_it / sum_t m_it] / #{i : sum_t m_it > 0}

The ``seq-mean`` denominator is a contract: the number of sequences with at least one
trained token, not the number of rows (a sample whose tokens are all masked, e.g. an
over-long one under ``overlong = "mask"``, does not dilute the mean; the seed divided by
all sequences). Micro-batches share the minibatch's denominator, so they sum exactly.

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

from consumers import losses

Agg = Literal["token-mean", "seq-mean"]


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


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-prob of each target under
    ``softmax(logits / temperature)``: the distribution the sampler drew from."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - logits.logsumexp(-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropy of the next-token distribution (a metric only)."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def normalizer(weights: torch.Tensor, agg: Agg) -> torch.Tensor:
    """The denominator of ``agg`` over a whole minibatch (shared by its micro-batches).

    token-mean: the trained tokens; seq-mean: the sequences with at least one trained token.
    """
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
    """The default (``grpo``) objective: :func:`policy_loss` with the PPO-clip terms."""
    return policy_loss(
        "grpo",
        params={"eps_low": eps_low, "eps_high": eps_high, "tis_cap": tis_cap},
        logp=logp,
        prox_logp=prox_logp,
        sampler_logp=sampler_logp,
        advantages=advantages,
        weights=weights,
        kl_coef=kl_coef,
        ref_logp=ref_logp,
        agg=agg,
        denom=denom,
    )


def policy_loss(
    name: str,
    *,
    params: dict[str, float],
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    agg: Agg = "token-mean",
    denom: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` of consumers/losses.py, aggregated, plus the KL term; and its statistics.

    The loss has grad through ``logp`` only. ``weights`` is 0 on prompt and padding
    positions and on masked completion tokens. Statistics (detached; token means are over
    trained tokens): policy_loss and kl (aggregated like the loss); clip_fraction and its
    sides clip_low_fraction / clip_high_fraction (tokens whose clip bound was the active
    term); ratio_mean (current vs proximal); ppo_kl (k3 of the proximal policy from the
    current one: KL(prox || current), how far this minibatch's updates moved); mismatch_kl (k3 of the trainer's
    proximal policy from the sampler's, on the sampled tokens: ~0 when sampler and trainer
    agree, the first sign of a broken inference engine or a temperature mismatch);
    is_weight_mean (after truncation) and is_weight_max (before).
    """
    prox_logp, sampler_logp = prox_logp.detach(), sampler_logp.detach()
    t = losses.terms(
        name,
        logp=logp,
        prox_logp=prox_logp,
        sampler_logp=sampler_logp,
        advantages=advantages,
        weights=weights,
        **params,
    )
    policy = aggregate(t.pg, weights, agg, denom)
    total = policy
    kl = torch.zeros((), device=logp.device)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = aggregate(_k3(ref_logp.detach(), logp), weights, agg, denom)
        total = total + kl_coef * kl
    with torch.no_grad():
        stats = {
            "policy_loss": policy.detach(),
            "kl": kl.detach(),
            **_token_stats(t, logp, prox_logp, sampler_logp, weights, params),
        }
    return total, stats


def _k3(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(p || q) per token from log q and log p on samples of p."""
    log_r = losses.log_ratio(log_q, log_p)
    return log_r.exp() - log_r - 1.0


def _token_stats(t, logp, prox_logp, sampler_logp, weights, params) -> dict[str, torch.Tensor]:
    trained = weights > 0
    n = trained.sum().clamp_min(1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * trained).sum() / n

    raw_is = (prox_logp - sampler_logp).clamp(max=losses.LOG_RATIO_CLAMP).exp()
    low, high = t.clipped_low & trained, t.clipped_high & trained
    return {
        "clip_fraction": mean(low | high),
        "clip_low_fraction": mean(low),
        "clip_high_fraction": mean(high),
        "ratio_mean": mean(t.ratio),
        "ppo_kl": mean(_k3(logp.detach(), prox_logp)),
        "mismatch_kl": mean(_k3(prox_logp, sampler_logp)),
        "is_weight_mean": mean(raw_is.clamp(max=params.get("tis_cap", float("inf")))),
        "is_weight_max": raw_is.masked_fill(~trained, 0.0).max(),
    }
