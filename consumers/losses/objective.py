"""The objective of a minibatch: a loss's per-token terms weighted and aggregated, plus the
KL term, and the statistics every step reports (formulas: consumers/losses/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from consumers.losses.terms import LOG_RATIO_CLAMP, log_ratio, params_of, resolve
from streamer.config import TrainerSection

Agg = Literal["token-mean", "seq-mean"]


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


def policy_loss(
    name: str,
    logp: torch.Tensor,
    mb,
    *,
    params: dict[str, float],
    kl_coef: float = 0.0,
    agg: Agg = "token-mean",
    denom: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` (consumers/losses/terms.py) of the current log-probs ``logp`` (b, T-1) on
    the micro-batch ``mb`` (a :class:`~consumers.batch.Batch`: its proximal, sampler and, for
    the KL term, reference log-probs, advantages and weights), aggregated, plus the KL term;
    and its statistics.

    The loss has grad through ``logp`` only. ``mb.weights`` is 0 on prompt and padding
    positions and on masked completion tokens. Statistics (detached; token means are over
    trained tokens): policy_loss and kl (aggregated like the loss); clip_fraction and its
    sides clip_low_fraction / clip_high_fraction (tokens whose clip bound was the active
    term); ratio_mean (current vs proximal); ppo_kl (k3 of the proximal policy from the
    current one: KL(prox || current), how far this minibatch's updates moved); mismatch_kl (k3 of the trainer's
    proximal policy from the sampler's, on the sampled tokens: ~0 when sampler and trainer
    agree, the first sign of a broken inference engine or a temperature mismatch);
    is_weight_mean (after truncation) and is_weight_max (before).
    """
    prox_logp, sampler_logp, weights = mb.prox_logp.detach(), mb.sampler_logp.detach(), mb.weights
    t = resolve(name)(
        logp=logp,
        prox_logp=prox_logp,
        sampler_logp=sampler_logp,
        advantages=mb.advantages,
        weights=weights,
        **params,
    )
    policy = aggregate(t.pg, weights, agg, denom)
    total = policy
    kl = torch.zeros((), device=logp.device)
    if kl_coef > 0:
        if mb.ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = aggregate(_k3(mb.ref_logp.detach(), logp), weights, agg, denom)
        total = total + kl_coef * kl
    with torch.no_grad():
        stats = {
            "policy_loss": policy.detach(),
            "kl": kl.detach(),
            **_token_stats(t, logp, prox_logp, sampler_logp, weights, params),
        }
    return total, stats


@dataclass(frozen=True)
class Objective:
    """The trainer's objective as configured (``trainer.loss`` and its keys, ``loss_agg``,
    ``kl_coef``): :func:`policy_loss` of a micro-batch."""

    name: str
    params: dict[str, float]
    agg: Agg
    kl_coef: float

    @classmethod
    def of(cls, cfg: TrainerSection) -> Objective:
        """From the trainer config (a bad ``trainer.loss`` import path fails here)."""
        return cls(cfg.loss, params_of(cfg.loss, cfg), cfg.aggregation, cfg.kl_coef)

    def normalizer(self, weights: torch.Tensor) -> torch.Tensor:
        return normalizer(weights, self.agg)

    def __call__(self, logp: torch.Tensor, mb, *, denom: torch.Tensor | None = None):
        return policy_loss(
            self.name, logp, mb, params=self.params, kl_coef=self.kl_coef, agg=self.agg, denom=denom
        )


def _k3(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(p || q) per token from log q and log p on samples of p."""
    log_r = log_ratio(log_q, log_p)
    return log_r.exp() - log_r - 1.0


def _token_stats(t, logp, prox_logp, sampler_logp, weights, params) -> dict[str, torch.Tensor]:
    trained = weights > 0
    n = trained.sum().clamp_min(1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * trained).sum() / n

    raw_is = (prox_logp - sampler_logp).clamp(max=LOG_RATIO_CLAMP).exp()
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
