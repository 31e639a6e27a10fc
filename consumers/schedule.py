"""The learning-rate schedule, counted in optimizer steps (one trainer step = ``ppo_minibatches`` of them).

With s the optimizer step (0-based), W = ``warmup_steps``, D = the decay length
(``lr_decay_steps``, or ``steps * ppo_minibatches`` when 0), m = ``min_lr_ratio``:

    s < W        lr * (s + 1) / W                                  linear warmup
    constant     lr
    linear       lr * (m + (1 - m) * (1 - p))                      p = min(1, (s - W) / (D - W))
    cosine       lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)
"""

from __future__ import annotations

import math

from streamer.config import TrainerSection


def lr_at(cfg: TrainerSection, step: int) -> float:
    """The LR of optimizer step ``step`` (0-based) under ``cfg``'s schedule."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay = cfg.lr_decay_steps or cfg.steps * cfg.ppo_minibatches  # D
    span = max(decay - warmup, 1)
    p = min(1.0, (step - warmup) / span)
    m = cfg.min_lr_ratio
    shape = 1.0 - p if cfg.lr_schedule == "linear" else (1.0 + math.cos(math.pi * p)) / 2
    return cfg.lr * (m + (1.0 - m) * shape)
