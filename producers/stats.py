"""Rollout metric values of a producer (names from ``schemas.metric_names.ROLLOUT``).

Counters are per-event increments (the exporter sums them); counts that happen between
published groups (weight loads, dropped groups) wait in :class:`Pending` and ride along
with the next event the producer sends.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from schemas import TrajectoryGroup
from schemas.metric_names import ROLLOUT


class Pending:
    """Counter increments and the latest load time not yet published."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.weight_load_seconds: float | None = None
        self._lock = threading.Lock()  # rows in flight add from the loop, drain from threads

    def add(self, name: str, n: float = 1) -> None:
        assert ROLLOUT[name][0] == "counter", name
        if n:
            with self._lock:
                self.counts[name] += n

    def drain(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self.counts.items()}
            if self.weight_load_seconds is not None:
                out["weight_load_seconds"] = self.weight_load_seconds
            self.counts.clear()
            self.weight_load_seconds = None
        return out

    def restore(self, drained: dict[str, float]) -> None:
        """Put back what :meth:`drain` took (the event that was to carry it was not sent)."""
        with self._lock:
            for name, v in drained.items():
                if name == "weight_load_seconds":
                    self.weight_load_seconds = self.weight_load_seconds or v
                else:
                    self.counts[name] += v

    def __bool__(self) -> bool:
        return bool(self.counts) or self.weight_load_seconds is not None


def group_values(
    group: TrajectoryGroup, *, failures: int, sample_seconds: float, admission_wait_seconds: float
) -> dict[str, float]:
    """The gauges and counters of one published group (its version offset and the seconds
    waited for room in the stream are the publish's to fill)."""
    rewards = _episode_rewards(group)
    lengths = [s.completion_len for s in group.samples]
    n = len(group.samples)
    values = {
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r > 0 for r in rewards) / len(rewards),
        "response_length_mean": sum(lengths) / n,
        "response_length_min": float(min(lengths)),
        "response_length_max": float(max(lengths)),
        "truncated_ratio": sum(s.finish_reason == "length" for s in group.samples) / n,
        "policy_version": float(group.policy_version),
        "sample_seconds": sample_seconds,
        "admission_wait_seconds": admission_wait_seconds,
        "groups": 1.0,
        "samples": float(n),
        "tokens": float(sum(lengths)),
    }
    if failures:
        values["sample_failures"] = float(failures)
    return values


def _episode_rewards(group: TrajectoryGroup) -> list[float]:
    """One reward per episode: the forks of an episode count once."""
    if all(s.episode is None for s in group.samples):
        return [s.reward for s in group.samples]
    first = np.unique(group.episode_index(), return_index=True)[1]
    return [group.samples[i].reward for i in first]


def episode_values(episodes, *, seconds: float, in_flight: int) -> dict[str, float]:
    """Multi-turn gauges and counters of one published group's episodes."""
    n = max(1, len(episodes))
    turns = [e.metrics.get("turns", 1.0) for e in episodes]
    return {
        "turns_mean": sum(turns) / n,
        "tool_calls": float(sum(e.metrics.get("tool_calls", 0.0) for e in episodes)),
        "proxy_divergences": float(sum(e.metrics.get("proxy_divergences", 0.0) for e in episodes)),
        "episode_forks": float(sum(len(e.forks) for e in episodes)),
        "episode_seconds": seconds,
        "in_flight_episodes": float(in_flight),
    }
