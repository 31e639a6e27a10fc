"""Accepted TrajectoryGroups -> padded training tensors.

Every per-token tensor is aligned to next-token *targets*: position t of a (B, T-1) tensor
is about ``input_ids[:, t + 1]``, predicted by ``logits[:, t]``. Completion token j of a
sample with prompt length p sits at input position p + j, so its weight, sampler log-prob
and target live at index p + j - 1. Prompt positions, padding and masked completion tokens
(``Sample.loss_mask()`` = 0) have weight 0. Samples of different prompt lengths mix freely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from consumers import advantages
from consumers.advantages import AdvantageFn
from consumers.loss import group_advantages
from schemas import TrajectoryGroup
from streamer.config import TrainerSection

_INPUT_FIELDS = ("input_ids", "attention_mask")  # (B, T); every other 2-D field is (B, T-1)


@dataclass(frozen=True)
class Batch:
    """One step's samples as tensors (CPU until :meth:`to`); rows are samples."""

    input_ids: torch.Tensor  # (B, T) int64, right-padded
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens
    weights: torch.Tensor  # (B, T-1) float32 per-target loss weight
    sampler_logp: torch.Tensor  # (B, T-1) float32, 0 where weight is 0
    advantages: torch.Tensor  # (B,) float32
    prox_logp: torch.Tensor | None = None  # (B, T-1) filled by the learner (no grad)
    ref_logp: torch.Tensor | None = None  # (B, T-1) reference model, when kl_coef > 0

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]  # (B, T-1)

    @property
    def num_tokens(self) -> int:
        """Trained tokens (weight > 0)."""
        return int((self.weights > 0).sum())

    def replace(self, **fields) -> Batch:
        return dataclasses.replace(self, **fields)

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def rows(self, index: torch.Tensor | slice) -> Batch:
        """The rows ``index``, with padding trimmed to their longest sample."""
        sub = self._map(lambda t: t[index])
        width = max(int(sub.attention_mask.sum(-1).max()) if sub.size else 0, 2)
        trimmed = {}
        for f in dataclasses.fields(sub):
            t = getattr(sub, f.name)
            if t is not None and t.dim() == 2:  # inputs keep `width` columns, targets one less
                t = t[:, :width] if f.name in _INPUT_FIELDS else t[:, : width - 1]
            trimmed[f.name] = t
        return Batch(**trimmed)

    def split(self, parts: int) -> list[Batch]:
        """``parts`` nearly equal slices of rows (fewer if there are fewer rows)."""
        chunks = torch.arange(self.size).tensor_split(min(parts, self.size))
        return [self.rows(c) for c in chunks if len(c)]

    def chunks(self, rows: int) -> list[Batch]:
        """Consecutive slices of at most ``rows`` rows (``rows`` <= 0: the whole batch)."""
        if rows <= 0 or rows >= self.size:
            return [self]
        return [self.rows(slice(i, i + rows)) for i in range(0, self.size, rows)]

    def _map(self, fn) -> Batch:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{name: None if t is None else fn(t) for name, t in fields.items()})


def advantages_of(
    group: TrajectoryGroup, *, std_normalize: bool, std_floor: float, advantage: AdvantageFn | None = None
) -> np.ndarray:
    """(G,) float32 advantages of one group's samples (``advantage`` None: the GRPO z-score)."""
    rewards = torch.from_numpy(group.rewards())
    if advantage is not None:
        return advantages.compute(advantage, rewards).numpy()
    return group_advantages(rewards, std_normalize=std_normalize, std_floor=std_floor).numpy()


def collator(cfg: TrainerSection) -> Callable[[Sequence[TrajectoryGroup]], Batch]:
    """``collate`` with the advantage function ``cfg.advantage`` names."""
    fn = advantages.resolve(cfg)
    return lambda groups: collate(groups, advantage=fn)


def collate(
    groups: Sequence[TrajectoryGroup],
    *,
    pad_id: int = 0,
    std_normalize: bool = True,
    std_floor: float = 1e-4,
    advantage: AdvantageFn | None = None,
) -> Batch:
    """Pad the samples of ``groups`` (in order) into one :class:`Batch` with group advantages."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise ValueError("collate needs at least one sample")
    adv = np.concatenate(
        [
            advantages_of(g, std_normalize=std_normalize, std_floor=std_floor, advantage=advantage)
            for g in groups
        ]
    )
    width = max(s.num_tokens for s in samples)
    n = len(samples)
    ids = np.full((n, width), pad_id, np.int64)
    attn = np.zeros((n, width), np.int64)
    weights = np.zeros((n, width - 1), np.float32)
    sampler = np.zeros((n, width - 1), np.float32)
    for i, s in enumerate(samples):
        t, p = s.num_tokens, s.prompt_len
        ids[i, :t] = s.token_ids()
        attn[i, :t] = 1
        weights[i, p - 1 : t - 1] = s.loss_mask()
        sampler[i, p - 1 : t - 1] = s.sampler_logprobs()
    sampler *= weights > 0
    return Batch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        weights=torch.from_numpy(weights),
        sampler_logp=torch.from_numpy(sampler),
        advantages=torch.from_numpy(adv.astype(np.float32)),
    )
