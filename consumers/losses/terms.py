"""The loss family behind ``trainer.loss``: per-token policy-gradient terms, pure tensor functions.

Every loss maps the same inputs to a (B, T) per-token term ``pg`` that
:func:`consumers.losses.policy_loss` then weights, aggregates (``trainer.loss_agg``) and adds
the KL term to. Shared notation, per trained token t of sample i with advantage A_i:

    r_t = exp(logp_t - prox_t)                       current vs proximal policy (ratio)
    w_t = min(exp(prox_t - sampler_t), tis_cap)      truncated importance weight (constant)
    sg[x]                                            x without gradient (detached)

With fresh data and one minibatch (``logp == prox == sampler``) every loss but
``importance_sampling`` has the gradient of plain on-policy GRPO, ``-A * grad(logp)`` per
token; they differ in how they bound the update once the policy moves or the data is stale.

Each function returns :class:`Terms`: ``pg`` (with grad through ``logp``), the ratio that
was clipped (detached) and which tokens the low and the high clip bound was active on.

**A loss of one's own**: ``trainer.loss = "package.module:function"`` names a function with
the built-ins' call signature, all keyword arguments, every tensor (B, T) float32 on the
training device except ``advantages`` (B,)::

    def my_loss(*, logp, prox_logp, sampler_logp, advantages, weights) -> Terms | torch.Tensor

``logp`` is the current policy's log-prob of each target token (the only input with a
gradient), ``prox_logp`` the proximal policy's (recomputed before the updates),
``sampler_logp`` the sampler's, ``weights`` the loss mask (0 on prompt, padding and masked
tokens; positions where it is 0 are ignored, whatever the function returns there). It
returns the per-token term ``pg`` to minimise, as a (B, T) tensor or as :class:`Terms`
(then its clip statistics are reported); aggregation (``trainer.loss_agg``: a user loss is
token-mean under "auto") and the KL term are added by the trainer. It takes no config keys:
constants live in the function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamer.config_trainer import LOSS_KEYS, TrainerSection
from streamer.imports import load_function

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Terms:
    pg: torch.Tensor  # (B, T) per-token loss term, before weights and aggregation
    ratio: torch.Tensor  # (B, T) detached ratio the clip acted on
    clipped_low: torch.Tensor  # (B, T) bool: the lower bound was the active term
    clipped_high: torch.Tensor  # (B, T) bool: the upper bound was the active term


def log_ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def tis_weight(prox_logp: torch.Tensor, sampler_logp: torch.Tensor, tis_cap: float) -> torch.Tensor:
    """w = min(exp(prox - sampler), tis_cap): corrects for the policy that sampled the data."""
    return log_ratio(prox_logp, sampler_logp).exp().clamp(max=tis_cap).detach()


def _ppo_terms(ratio, adv, w, eps_low, eps_high, grad_ratio=None) -> Terms:
    """-w * min(r A, clip(r, 1-eps_low, 1+eps_high) A), with the clip-side masks."""
    r = ratio if grad_ratio is None else grad_ratio
    clipped = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = -w * torch.minimum(r * adv, clipped * adv)
    ratio = ratio.detach()
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    return Terms(pg, ratio, low, high)


def grpo(*, logp, prox_logp, sampler_logp, advantages, weights, tis_cap, eps_low, eps_high) -> Terms:
    """Decoupled PPO-clip (the default)::

    pg_t = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

    Reads ``trainer.eps_low``, ``trainer.eps_high``, ``trainer.tis_cap``.
    """
    adv = advantages.detach().float().unsqueeze(-1)  # (B, 1)
    ratio = log_ratio(logp, prox_logp.detach()).exp()
    return _ppo_terms(ratio, adv, tis_weight(prox_logp, sampler_logp, tis_cap), eps_low, eps_high)


def dapo(
    *, logp, prox_logp, sampler_logp, advantages, weights, tis_cap, eps_low, eps_high, eps_clip_c
) -> Terms:
    """DAPO's clip-higher (asymmetric bounds) with dual-clip for negative advantages::

    pg_t = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)           A >= 0
    pg_t = -w_t * max(min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A), c A)   A < 0

    The dual clip (c = ``eps_clip_c`` > 1) bounds the loss of a token whose ratio grew far
    past 1 under a negative advantage: beyond r > c the term is the constant ``-w c A``
    (no gradient), so one very off-policy token cannot dominate the step. Such tokens
    count as clipped on the high side. Reads ``[trainer.dapo]`` and ``trainer.tis_cap``.
    """
    adv = advantages.detach().float().unsqueeze(-1)
    ratio = log_ratio(logp, prox_logp.detach()).exp()
    w = tis_weight(prox_logp, sampler_logp, tis_cap)
    t = _ppo_terms(ratio, adv, w, eps_low, eps_high)
    dual = (adv < 0) & (ratio.detach() > eps_clip_c)  # where c A > min(r A, clip(r) A)
    pg = torch.where(dual, -w * eps_clip_c * adv, t.pg)
    return Terms(pg, t.ratio, t.clipped_low, t.clipped_high | dual)


def gspo(*, logp, prox_logp, sampler_logp, advantages, weights, tis_cap, eps_low, eps_high) -> Terms:
    """GSPO: one length-normalised ratio per sequence (GSPO-token form)::

    s_i   = exp(sum_t m_t (logp_t - prox_t) / sum_t m_t)        m_t = 1 on trained tokens
    s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])                  value s_i, grad s_i * grad logp_t
    W_i   = min(exp(sum_t m_t (prox_t - sampler_t) / sum_t m_t), tis_cap)
    pg_t  = -W_i * min(s_i,t A, clip(s_i,t, 1 - eps_low, 1 + eps_high) A)

    The whole sequence is clipped or not, so the bounds are much tighter than per-token
    PPO's (defaults 3e-4 / 4e-4). Aggregated by ``seq-mean`` (the paper's sequence-mean of
    token-means; what ``loss_agg = "auto"`` picks for gspo: token-mean would weigh each
    sequence by its length). Reads ``[trainer.gspo]`` and ``trainer.tis_cap``.
    """
    adv = advantages.detach().float().unsqueeze(-1)
    m = (weights > 0).float()
    n = m.sum(-1, keepdim=True).clamp_min(1.0)  # (B, 1)
    seq_log = ((logp - prox_logp.detach()) * m).sum(-1, keepdim=True) / n  # (B, 1)
    s = seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().detach()
    grad_ratio = s * (logp - logp.detach()).exp()  # (B, T): value s_i, gradient s_i * dlogp
    seq_is = ((prox_logp - sampler_logp).detach() * m).sum(-1, keepdim=True) / n
    w = seq_is.clamp(max=LOG_RATIO_CLAMP).exp().clamp(max=tis_cap)
    return _ppo_terms(s.expand_as(logp), adv, w, eps_low, eps_high, grad_ratio=grad_ratio)


def cispo(*, logp, prox_logp, sampler_logp, advantages, weights, tis_cap, eps_low, eps_high) -> Terms:
    """CISPO: clip the importance-sampling weight, never the token's gradient::

    pg_t = -w_t * sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * logp_t

    PPO-clip zeroes the gradient of clipped tokens (often the rare, decisive ones); CISPO
    keeps every token's gradient and only bounds its weight. Reads ``[trainer.cispo]``
    and ``trainer.tis_cap``.
    """
    adv = advantages.detach().float().unsqueeze(-1)
    ratio = log_ratio(logp, prox_logp.detach()).exp().detach()
    w = tis_weight(prox_logp, sampler_logp, tis_cap)
    pg = -w * ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv * logp
    return Terms(pg, ratio, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high)


def reinforce(*, logp, prox_logp, sampler_logp, advantages, weights, tis_cap) -> Terms:
    """REINFORCE with the truncated importance weight, no trust region::

    pg_t = -w_t * A * logp_t

    The plain policy gradient: fine on fresh data with one minibatch, unbounded once the
    policy moves within a step. Reads ``trainer.tis_cap``.
    """
    adv = advantages.detach().float().unsqueeze(-1)
    ratio = log_ratio(logp, prox_logp.detach()).exp().detach()
    pg = -tis_weight(prox_logp, sampler_logp, tis_cap) * adv * logp
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Terms(pg, ratio, none, none)


def importance_sampling(*, logp, prox_logp, sampler_logp, advantages, weights) -> Terms:
    """Importance sampling straight against the sampler, unclipped and untruncated::

    pg_t = -exp(logp_t - sampler_t) * A

    Unbiased for any sampler policy, high-variance when it is far from the current one.
    Reads no keys (``tis_cap`` and the clip bounds do not apply).
    """
    adv = advantages.detach().float().unsqueeze(-1)
    pg = -log_ratio(logp, sampler_logp.detach()).exp() * adv
    ratio = log_ratio(logp, prox_logp.detach()).exp().detach()
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Terms(pg, ratio, none, none)


def dro(*, logp, prox_logp, sampler_logp, advantages, weights, beta) -> Terms:
    """DRO (the seed's objective): the policy gradient with a quadratic penalty that keeps
    the policy near the one that sampled the data, instead of a clip or an importance weight::

    pg_t = -(A * logp_t - beta / 2 * (logp_t - sampler_t)^2)

    On fresh data the penalty and its gradient are 0 (plain GRPO); once the policy moves
    away from the sampler's the penalty pulls it back, smoothly, at every token. Reads
    ``[trainer.dro]``.
    """
    adv = advantages.detach().float().unsqueeze(-1)
    drift = logp - sampler_logp.detach()
    pg = -(adv * logp - 0.5 * beta * drift.square())
    ratio = log_ratio(logp, prox_logp.detach()).exp().detach()
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Terms(pg, ratio, none, none)


LOSSES = {
    "grpo": grpo,
    "dapo": dapo,
    "gspo": gspo,
    "cispo": cispo,
    "reinforce": reinforce,
    "importance_sampling": importance_sampling,
    "dro": dro,
}
LossFn = Callable[..., Terms]


def params_of(name: str, cfg: TrainerSection) -> dict[str, float]:
    """The keyword arguments loss ``name`` takes from the trainer config (beyond the tensors);
    none for a loss of one's own (loaded here, so a bad import path fails early)."""
    if name not in LOSSES:
        resolve(name)
        return {}
    out = {}
    for key in LOSS_KEYS[name]:
        section, _, field = key.rpartition(".")
        out[field] = getattr(getattr(cfg, section) if section else cfg, field)
    return out


@functools.cache
def resolve(name: str) -> LossFn:
    """The loss ``name`` names: a built-in, or a ``module:function`` of one's own (wrapped to
    return :class:`Terms`); a ConfigError naming ``trainer.loss`` if it cannot be loaded."""
    if name in LOSSES:
        return LOSSES[name]
    if ":" not in name:
        raise ValueError(f"unknown loss {name!r}; one of {', '.join(LOSSES)} or 'module:function'")
    fn = load_function(name, what="`trainer.loss`")

    @functools.wraps(fn)
    def user_loss(*, logp, prox_logp, sampler_logp, advantages, weights) -> Terms:
        out = fn(
            logp=logp, prox_logp=prox_logp, sampler_logp=sampler_logp, advantages=advantages, weights=weights
        )
        if isinstance(out, Terms):
            return out
        if not isinstance(out, torch.Tensor) or out.shape != logp.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"loss {name!r} returned {got}; expected Terms or a {tuple(logp.shape)} tensor")
        ratio = log_ratio(logp, prox_logp.detach()).exp().detach()
        none = torch.zeros_like(ratio, dtype=torch.bool)
        return Terms(out, ratio, none, none)

    return user_loss
