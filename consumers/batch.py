"""Accepted TrajectoryGroups -> padded training tensors.

Every per-token tensor is aligned to next-token *targets*: position t of a (B, T-1) tensor
is about ``input_ids[:, t + 1]``, predicted by ``logits[:, t]``. Completion token j of a
sample with prompt length p sits at input position p + j, so its weight, sampler log-prob
and target live at index p + j - 1. Prompt positions, padding and masked completion tokens
(``Sample.loss_mask()`` = 0) have weight 0. Samples of different prompt lengths mix freely.

Micro-batches (:meth:`Batch.micro_batches`) are slices of ``trainer.micro_batch_size`` rows,
or, with ``trainer.micro_batch_tokens``, rows sorted by length and filled up to a token
budget, so a short sample is not padded to the longest one of the step. Where the model's
attention can tell sequences apart by their position ids (checked once, see
consumers/learner.py), a micro-batch is :func:`pack`-ed: its rows' real tokens end to end in
one row, no padding at all; the log-probs are laid back out as (b, T-1) before the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from consumers import advantages
from consumers.advantages import AdvantageFn
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

    def micro_batches(self, *, rows: int = 0, tokens: int = 0, packed: bool = False) -> list[torch.Tensor]:
        """Row indices of each micro-batch: consecutive slices of ``rows`` rows (<= 0: all), or,
        with ``tokens`` > 0, the rows longest first, each micro-batch filled while its tokens
        stay within ``tokens``: counted with padding to its longest row, or as they are when
        ``packed``. A row longer than the budget is a micro-batch of its own."""
        if tokens <= 0:
            step = rows if 0 < rows < self.size else max(self.size, 1)
            return [torch.arange(i, min(i + step, self.size)) for i in range(0, self.size, step)]
        lengths = self.attention_mask.sum(-1).tolist()
        order = sorted(range(self.size), key=lambda i: -lengths[i])  # stable: ties keep row order
        out: list[list[int]] = []
        used = 0  # the current micro-batch's tokens, padding included unless packed
        for i in order:
            n = lengths[i]
            # sorted longest first: the current micro-batch's first row sets its padded width
            cost = (used + n if packed else (len(out[-1]) + 1) * lengths[out[-1][0]]) if out else n
            if out and cost <= tokens:
                out[-1].append(i)
            else:
                out.append([i])
                cost = n
            used = cost
        return [torch.tensor(sorted(ix)) for ix in out]

    def _map(self, fn) -> Batch:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{name: None if t is None else fn(t) for name, t in fields.items()})


@dataclass(frozen=True)
class Packed:
    """A micro-batch's rows end to end in one row, without padding: token i of row r sits at
    ``offset[r] + i``, with position id i, so the attention keeps the rows apart (transformers
    builds a block-diagonal causal mask from the position ids, or flash-attention's varlen
    bounds). ``index``/``valid`` map each (b, T-1) target position to its packed one."""

    input_ids: torch.Tensor  # (1, L) int64, L = the rows' real tokens
    position_ids: torch.Tensor  # (1, L) int64, restarting at 0 for every row
    index: torch.Tensor  # (b, T-1) int64 packed target position (0 where not valid)
    valid: torch.Tensor  # (b, T-1) bool: a real target of the row

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]  # (1, L-1); a row's last token "predicts" the next row's first

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, L-1) per packed target -> (b, T-1), 0 where no target."""
        return packed[0][self.index] * self.valid

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(b, T-1) -> (1, L-1), 0 at the positions between rows."""
        out = padded.new_zeros(1, self.input_ids.shape[1] - 1)
        out[0, self.index[self.valid]] = padded[self.valid]
        return out


def pack(mb: Batch) -> Packed:
    """The :class:`Packed` layout of ``mb``'s rows (right-padded, as :func:`collate` makes them)."""
    real = mb.attention_mask.bool()  # (b, T)
    lengths = real.sum(-1)  # (b,)
    offsets = lengths.cumsum(0) - lengths  # (b,) first packed position of each row
    positions = real.long().cumsum(-1) - 1  # (b, T) position within its row
    width = mb.weights.shape[1]
    t = torch.arange(width, device=lengths.device)
    valid = t.unsqueeze(0) < (lengths - 1).unsqueeze(-1)  # (b, T-1)
    index = (offsets.unsqueeze(-1) + t.unsqueeze(0)) * valid
    return Packed(
        input_ids=mb.input_ids[real].unsqueeze(0),
        position_ids=positions[real].unsqueeze(0),
        index=index,
        valid=valid,
    )


def advantages_of(
    group: TrajectoryGroup, *, std_normalize: bool, std_floor: float, advantage: AdvantageFn | None = None
) -> np.ndarray:
    """(S,) float32 advantages of one group's samples (``advantage`` None: the GRPO z-score).

    Computed over the group's episodes, then given to each of an episode's samples: the
    forks of one episode count once in the baseline and share its advantage."""
    forked = any(s.episode is not None for s in group.samples)
    rewards = torch.from_numpy(group.episode_rewards() if forked else group.rewards())
    if advantage is not None:
        adv = advantages.compute(advantage, rewards).numpy()
    else:
        adv = advantages.group_advantages(rewards, std_normalize=std_normalize, std_floor=std_floor).numpy()
    return adv[group.episode_index()] if forked else adv


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
