"""The GRPO/PPO objective as pure tensor functions (no model, no I/O), testable by hand.

Per trained token t of sample i, with group advantage A_i:

    ratio_t  = exp(clamp(logp_t - prox_t, ±20))                 policy vs proximal policy
    w_t      = min(exp(prox_t - sampler_t), tis_cap)            truncated importance weight
    pg_t     = -w_t * min(ratio_t * A_i, clip(ratio_t, 1-eps_low, 1+eps_high) * A_i)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       k3 estimator (kl_coef > 0)
    loss     = agg(pg_t + kl_coef * kl_t)                        token-mean or seq-mean

``pg_t`` above is the default ``grpo`` term; ``trainer.loss`` picks another from the family
in ``terms`` (dapo, gspo, cispo, reinforce, importance_sampling, dro, or one of one's own),
aggregated the same way by ``objective`` (``trainer.loss_agg = "auto"``: seq-mean for gspo,
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

The package: ``terms`` (the loss family: per-token terms, and a loss of one's own),
``objective`` (aggregation, the KL term, the step's statistics); the names below are its API.
"""

from consumers.losses.objective import Objective, normalizer, policy_loss, token_entropy, token_logprobs
from consumers.losses.terms import LOSSES, Terms, params_of, resolve

__all__ = [
    "LOSSES",
    "Objective",
    "Terms",
    "normalizer",
    "params_of",
    "policy_loss",
    "resolve",
    "token_entropy",
    "token_logprobs",
]
