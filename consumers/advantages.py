"""Group advantages behind ``trainer.advantage``: (G,) rewards of one group -> (G,) advantages.

    grpo     A_i = (r_i - mean(r)) / max(std(r), std_floor)    (std_normalize = false: no division)
    dr_grpo  A_i = r_i - mean(r)                                 Dr. GRPO: no std (no difficulty bias)
    rloo     A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean(r))   leave-one-out baseline

Any other value is an import path (``module:function``) of a function ``(rewards) ->
advantages`` on float64 tensors. Built-ins need two samples per group; a user function
that works on one sample says so with a ``min_group_size = 1`` attribute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from consumers.filters import load_predicate
from streamer.config import TrainerSection
from streamer.errors import ConfigError

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]


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


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    rewards = rewards.double()
    return rewards - rewards.mean()


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    rewards = rewards.double()
    g = rewards.numel()
    if g < 2:
        return torch.zeros_like(rewards)  # no other sample to compare with
    return (rewards - rewards.mean()) * (g / (g - 1))


def resolve(cfg: TrainerSection) -> AdvantageFn:
    """The advantage function ``cfg.advantage`` names (ConfigError if it cannot be loaded)."""
    name = cfg.advantage
    if name == "grpo":
        return lambda r: group_advantages(r, std_normalize=cfg.std_normalize, std_floor=cfg.std_floor)
    if name == "dr_grpo":
        return dr_grpo
    if name == "rloo":
        return rloo
    return load_predicate(name, what="`trainer.advantage`")


def min_group_size_of(fn: AdvantageFn) -> int:
    """Samples a group needs for ``fn`` to tell them apart (2 unless ``fn`` says otherwise)."""
    return int(getattr(fn, "min_group_size", 2))


def check_group_size(fn: AdvantageFn, *, group_size: int, min_group_size: int) -> None:
    """ConfigError when groups may be smaller than ``fn`` can use (every group would teach nothing)."""
    need = min_group_size_of(fn)
    if min(group_size, min_group_size) < need:
        raise ConfigError(
            f"`trainer.advantage` needs {need} samples per group, but producer.group_size = {group_size} "
            f"and trainer.min_group_size = {min_group_size}"
        )


def compute(fn: AdvantageFn, rewards: torch.Tensor) -> torch.Tensor:
    """(G,) float32 advantages; a clear error when a user function returns the wrong shape."""
    out = torch.as_tensor(fn(rewards.double()))
    if out.shape != rewards.shape:
        raise ValueError(
            f"advantage function returned shape {tuple(out.shape)} for {tuple(rewards.shape)} rewards"
        )
    return out.float()
