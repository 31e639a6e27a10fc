"""Eval sets: what the evaluator scores at each version, and how (pass@k, mean@k).

The ``[eval]`` keys are the set named ``default``: ``eval.dataset``, greedy, one sample
per row, the producers' rollout and reward (``eval.dataset = ""`` drops it). Each
``[eval.sets.NAME]`` adds a set with its own rows, ``k`` samples per row (``samples`` =
n >= k for the unbiased estimator), temperature (0 = greedy), length cap, rollout and
reward. Every set is checked before any model loads: a set whose rows lack a field its
reward needs is a :class:`DatasetError` naming the set.

Scores of a set, from each row's n samples (a sample the rollout did not return, or whose
reward raised, counts as a failure with reward 0); a sample succeeds when its reward is
> 0, or when its episode reports ``metrics["success"] > 0``:

- ``mean_at_k``: the ratio of a row's samples that succeed, averaged over rows (mean@k;
  ``accuracy`` is the same number under the name dashboards have always shown);
- ``pass_at_k``: the unbiased estimator of Chen et al. (2021), per row with c successes
  ``1 - C(n - c, k) / C(n, k)`` (the chance that k of the n samples, drawn without
  replacement, hold a success), averaged over rows. With n = k it is "any success".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from producers import rewards
from producers.components import load_reward, load_rollout
from producers.dataset import check_required, load_rows
from streamer.config import RunConfig
from streamer.config_rollout import DEFAULT_SET, EvalSetSection
from streamer.errors import ConfigError, DatasetError
from streamer.rollout.contract import DEFAULT_ROLLOUT, RewardFn

__all__ = ["EvalSet", "RowScores", "pass_at_k", "prepare", "summarize"]


@dataclass(frozen=True)
class EvalSet:
    """One set, resolved: its rows, reward, rollout and sampling settings."""

    name: str
    rows: Sequence[dict]  # a list, or rows read on demand (producers.lazy_rows.Rows)
    reward_fn: RewardFn
    reward_path: str
    rollout: str  # import path or service URL; "" = single-turn
    k: int
    n: int  # completions per row
    temperature: float
    top_p: float
    max_new_tokens: int

    @property
    def single_turn(self) -> bool:
        return self.rollout in ("", DEFAULT_ROLLOUT)


@dataclass
class RowScores:
    """What a row's samples scored (as many entries as samples came back)."""

    rewards: list[float]
    successes: list[bool]
    lengths: list[int]  # completion tokens (a multi-turn episode: everything after the prompt)


def configured(cfg: RunConfig) -> list[tuple[str, EvalSetSection]]:
    """(name, settings) of every set in evaluation order: ``default`` first."""
    e = cfg.eval
    out = []
    if e.dataset:
        out.append((DEFAULT_SET, EvalSetSection(dataset=e.dataset, max_rows=e.max_rows)))
    return out + list(e.sets.items())


def prepare(cfg: RunConfig) -> list[EvalSet]:
    """Every set with its rows and reward loaded and checked; no model is needed."""
    return [_prepare(cfg, name, s) for name, s in configured(cfg)]


def _prepare(cfg: RunConfig, name: str, s: EvalSetSection) -> EvalSet:
    where = f"eval set {name!r} ({s.dataset})"
    path = rewards.default_path(s.reward or cfg.producer.reward, s.dataset)
    rollout = s.rollout or cfg.producer.rollout
    try:
        rows = load_rows(s.dataset, split="eval", cache_dir=cfg.dataset_cache_dir)
        reward_fn = load_reward(cfg, path)
        if not rollout.startswith(("http://", "https://")):
            load_rollout(rollout)
    except (ConfigError, ValueError) as e:
        raise DatasetError(f"{where}: {e}") from None
    rows = rows[: s.max_rows] if s.max_rows else rows
    if rollout in ("", DEFAULT_ROLLOUT):  # a rollout of the user's may score rows its own way
        check_required(rows, getattr(reward_fn, "required_fields", ()), source=where, reward=path)
    return EvalSet(
        name=name,
        rows=rows,
        reward_fn=reward_fn,
        reward_path=path,
        rollout=rollout,
        k=s.k,
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens or cfg.eval.max_new_tokens,
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one row: c successes among n samples, 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    total = math.comb(n, k)  # exact integers, one correctly rounded division
    return (total - math.comb(n - c, k)) / total  # comb(m, k) = 0 when k > m


def summarize(scores: list[RowScores], *, n: int, k: int) -> dict[str, float]:
    """A set's metrics (names of ``schemas.metric_names.EVAL`` but the timing)."""
    rows = len(scores)
    successes = [sum(s.successes[:n]) for s in scores]  # c of each row
    lengths = [x for s in scores for x in s.lengths[:n]]
    mean_at_k = sum(c / n for c in successes) / rows
    return {
        "reward_mean": sum(sum(s.rewards[:n]) for s in scores) / (rows * n),
        "accuracy": mean_at_k,
        "mean_at_k": mean_at_k,
        "pass_at_k": sum(pass_at_k(n, c, k) for c in successes) / rows,
        "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "rows": float(rows),
        "k": float(k),
        "samples": float(n),
    }
