"""Which trajectory groups the trainer trains on, and why the others are rejected.

A verdict is either an accepted group (possibly with over-long samples dropped or masked)
or a reason from ``schemas.metric_names.REJECT_REASONS``. The checks, in order:

1. ``stale``: ``version - group.policy_version > max_staleness``;
   ``too_long``: a sample (prompt + completion) longer than ``trainer.max_seq_len`` tokens
   (it would not fit the model's context or the step's memory budget; 0 = no limit);
2. ``too_few_samples``: fewer than ``min_group_size`` complete samples (aborted samples,
   ``finish_reason == "abort"``, are incomplete and always dropped); the forks of one
   episode (``Sample.episode``) count as one sample here and below;
3. ``overlong``: samples truncated without EOS (``finish_reason == "length"``) are dropped
   (``drop``), kept with zero loss weight (``mask``) or kept as they are (``keep``); the
   group is rejected when that leaves fewer than ``min_group_size`` trainable samples;
4. ``zero_variance``: every reward equal, so every advantage is 0 and the group teaches
   nothing (it would only dilute the token-mean); a group of one sample is exempt (only an
   advantage function that works on one sample gets those, see consumers/advantages.py);
5. ``user_filter``: a ``(group) -> bool`` function named by import path returned False.

Groups that decode but cannot be trained at all (:func:`unusable`: token ids outside the
vocabulary, NaN log-probs, rewards beyond float32) never get here: the trainer's consumer
dead-letters them with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from schemas import Sample, TrajectoryGroup
from schemas.events import LOGPROB_DTYPE, TOKEN_DTYPE
from streamer.config import TrainerSection
from streamer.errors import ConfigError
from streamer.imports import load_function

log = logging.getLogger(__name__)

GroupPredicate = Callable[[TrajectoryGroup], bool]
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, slots=True)
class Verdict:
    group: TrajectoryGroup | None  # the group to train (maybe with samples dropped/masked)
    reason: str | None = None  # one of REJECT_REASONS when rejected

    @property
    def accepted(self) -> bool:
        return self.reason is None


def unusable(group: TrajectoryGroup, *, vocab_size: int) -> str | None:
    """Why a decoded group cannot be trained (its entry is dead-lettered), or None.

    A group that decodes may still crash or poison a step: token ids outside the model's
    embedding (an IndexError that would kill the trainer on every restart), NaN/inf
    sampler log-probs, or rewards that overflow float32 (NaN advantages, NaN weights).
    """
    tokens = np.frombuffer(b"".join(s.tokens for s in group.samples), TOKEN_DTYPE)
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        return f"token ids outside the model's vocabulary [0, {vocab_size}): {tokens.min()}..{tokens.max()}"
    if not np.isfinite(np.frombuffer(b"".join(s.logprobs for s in group.samples), LOGPROB_DTYPE)).all():
        return "sampler log-probs contain NaN or infinity"
    if any(abs(s.reward) > _F32_MAX for s in group.samples):
        return "a reward does not fit float32"
    return None


def is_stale(
    group: TrajectoryGroup, *, version: int, max_staleness: int, staleness: Callable | None = None
) -> bool:
    """``staleness(group)`` (consumers/lineage.py) if given, else version numbers apart."""
    lag = staleness(group) if staleness is not None else version - group.policy_version
    return lag > max_staleness


def load_predicate(path: str, *, what: str = "`trainer.user_filter`") -> GroupPredicate:
    """``module:function`` (or ``module.function``) -> the callable; ConfigError if not."""
    return load_function(path, what=what, dotted=True)


class GroupFilter:
    """The trainer's filters, configured once; call it with a group and the current version."""

    def __init__(
        self,
        *,
        max_staleness: int,
        min_group_size: int = 1,
        overlong: str = "drop",
        user_filter: GroupPredicate | None = None,
        max_seq_len: int = 0,
    ):
        if overlong not in ("drop", "mask", "keep"):
            raise ConfigError(f"`trainer.overlong` must be drop, mask or keep, got {overlong!r}")
        self.max_staleness, self.min_group_size = max_staleness, min_group_size
        self.overlong, self.user_filter, self.max_seq_len = overlong, user_filter, max_seq_len

    @classmethod
    def from_config(cls, cfg: TrainerSection) -> GroupFilter:
        return cls(
            max_staleness=cfg.max_staleness,
            min_group_size=cfg.min_group_size,
            overlong=cfg.overlong,
            user_filter=load_predicate(cfg.user_filter) if cfg.user_filter else None,
            max_seq_len=cfg.max_seq_len,
        )

    def is_stale(self, group: TrajectoryGroup, *, version: int, staleness: Callable | None = None) -> bool:
        return is_stale(group, version=version, max_staleness=self.max_staleness, staleness=staleness)

    def __call__(self, group: TrajectoryGroup, *, version: int, staleness: Callable | None = None) -> Verdict:
        if self.is_stale(group, version=version, staleness=staleness):
            return Verdict(None, "stale")
        if self.max_seq_len and any(s.num_tokens > self.max_seq_len for s in group.samples):
            return Verdict(None, "too_long")
        complete = [s for s in group.samples if s.finish_reason != "abort"]
        if _num_episodes(complete) < self.min_group_size:
            return Verdict(None, "too_few_samples")
        group = self._handle_overlong(group, complete)
        if group is None:
            return Verdict(None, "overlong")
        rewards = group.episode_rewards()
        if len(rewards) > 1 and bool((rewards == rewards[0]).all()):
            return Verdict(None, "zero_variance")
        if self.user_filter is not None and not self._user_accepts(group):
            return Verdict(None, "user_filter")
        return Verdict(group)

    def _handle_overlong(self, group: TrajectoryGroup, samples: list[Sample]) -> TrajectoryGroup | None:
        if self.overlong == "drop":
            samples = [s for s in samples if s.finish_reason != "length"]
        elif self.overlong == "mask":
            samples = [_zero_weight(s) if s.finish_reason == "length" else s for s in samples]
        trainable = [s for s in samples if s.loss_mask().any()]
        if _num_episodes(trainable) < max(self.min_group_size, 1):
            return None
        if len(samples) == len(group.samples) and all(a is b for a, b in zip(samples, group.samples)):
            return group
        oldest = min(s.version for s in samples)
        return msgspec.structs.replace(group, samples=samples, policy_version=oldest)

    def _user_accepts(self, group: TrajectoryGroup) -> bool:
        try:
            return bool(self.user_filter(group))
        except Exception:  # a user's bug rejects the group, loudly, instead of killing training
            log.exception("user filter raised on group %s; rejecting it", group.group_id)
            return False


def _num_episodes(samples: list[Sample]) -> int:
    """Episodes among ``samples``: the forks of one count once."""
    if all(s.episode is None for s in samples):
        return len(samples)
    return len({-1 - i if s.episode is None else s.episode for i, s in enumerate(samples)})


def _zero_weight(sample: Sample) -> Sample:
    return msgspec.structs.replace(sample, mask=bytes(sample.completion_len))
