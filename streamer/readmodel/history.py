"""The run's curves as a fold of metrics events, bounded whatever the run's length.

:class:`History` is what `up`'s progress view prints and what `streamer plot` draws:
rollout reward and eval accuracy against policy version (and each eval set's mean@k and
pass@k), loss, staleness and groups rejected per accepted group against train step. Each curve is a :class:`Curve` of (sum, count) per x bucket; past ``MAX_POINTS``
buckets the bucket width doubles and neighbours merge, so a curve holds at most
``MAX_POINTS`` points over any number of steps. It is a msgspec Struct: the exporter
saves it inside its state snapshot (:mod:`streamer.readmodel.saved`), so the metrics stream can
be trimmed and the curves still cover the whole run.
"""

from __future__ import annotations

import msgspec

from schemas import MetricsEvent
from schemas.metric_names import DEFAULT_EVAL_SET

MAX_POINTS = 2048
WINDOW = 32  # rollout groups in the moving mean of reward
MAX_SETS = 16  # eval sets with curves of their own; later ones are not drawn


class Curve(msgspec.Struct, kw_only=True):
    bucket: int = 1  # x width of one point
    points: dict[int, tuple[float, int]] = msgspec.field(default_factory=dict)  # x -> (sum, n)

    def add(self, x: int, y: float) -> None:
        key = x - x % self.bucket
        s, n = self.points.get(key, (0.0, 0))
        self.points[key] = (s + y, n + 1)
        if len(self.points) > MAX_POINTS:
            self.bucket *= 2
            merged: dict[int, tuple[float, int]] = {}
            for k, (s, n) in self.points.items():
                k -= k % self.bucket
                s0, n0 = merged.get(k, (0.0, 0))
                merged[k] = (s0 + s, n0 + n)
            self.points = merged

    def means(self) -> dict[int, float]:
        return {x: s / n for x, (s, n) in sorted(self.points.items())}

    def counts(self) -> dict[int, int]:
        return {x: n for x, (_, n) in sorted(self.points.items())}


class SetCurves(msgspec.Struct, kw_only=True):
    """One eval set's scores by policy version."""

    k: int = 1  # the k of its pass@k
    accuracy: Curve = msgspec.field(default_factory=Curve)  # mean@k
    pass_at_k: Curve = msgspec.field(default_factory=Curve)


class History(msgspec.Struct, kw_only=True):
    train_step: int = 0
    steps_skipped: int = 0  # trainer steps that changed no weights (their groups dead-lettered)
    groups: int = 0
    eval_step: int = -1
    eval_accuracy: float | None = None
    first_reward: float | None = None  # mean of the first WINDOW groups
    recent_rewards: list[float] = msgspec.field(default_factory=list)  # the last WINDOW
    reward_by_version: Curve = msgspec.field(default_factory=Curve)
    eval_by_version: Curve = msgspec.field(default_factory=Curve)
    loss_by_step: Curve = msgspec.field(default_factory=Curve)
    staleness_by_step: Curve = msgspec.field(default_factory=Curve)
    rejected_by_step: Curve = msgspec.field(default_factory=Curve)  # groups rejected per accepted one
    headline_set: str = ""  # the set eval_step / eval_accuracy / eval_by_version follow: the first seen
    eval_sets: dict[str, SetCurves] = msgspec.field(default_factory=dict)

    def apply(self, e: MetricsEvent) -> None:
        v = e.values
        if e.axis == "train":
            self.train_step = max(self.train_step, e.step)
            self.steps_skipped += int(v.get("steps_skipped", 0))
            if (loss := v.get("loss")) is not None:
                self.loss_by_step.add(e.step, loss)
            if (lag := v.get("staleness_mean")) is not None:
                self.staleness_by_step.add(e.step, lag)
            if accepted := v.get("groups_accepted"):
                rejected = sum(x for k, x in v.items() if k.startswith("groups_rejected_"))
                self.rejected_by_step.add(e.step, rejected / accepted)
        elif e.axis == "rollout":
            self.groups += int(v.get("groups", 1))
            if (r := v.get("reward_mean")) is not None:
                self.recent_rewards = [*self.recent_rewards[-(WINDOW - 1) :], r]
                if len(self.recent_rewards) == WINDOW and self.first_reward is None:
                    self.first_reward = self.reward()
                self.reward_by_version.add(int(v.get("policy_version", -1)), r)
        elif e.axis == "eval":
            name = e.eval_set or DEFAULT_EVAL_SET
            self._apply_set(name, e.step, v)
            self.headline_set = self.headline_set or name  # the evaluator scores the default set first
            if name != self.headline_set:
                return
            if (acc := v.get("accuracy")) is not None:
                self.eval_by_version.add(e.step, acc)
            if e.step >= self.eval_step:
                self.eval_step, self.eval_accuracy = e.step, acc

    def _apply_set(self, name: str, version: int, v: dict[str, float]) -> None:
        curves = self.eval_sets.get(name)
        if curves is None:
            if len(self.eval_sets) >= MAX_SETS:
                return
            curves = self.eval_sets[name] = SetCurves()
        curves.k = int(v.get("k", curves.k))
        if (acc := v.get("accuracy")) is not None:
            curves.accuracy.add(version, acc)
        if (p := v.get("pass_at_k")) is not None:
            curves.pass_at_k.add(version, p)

    def reward(self) -> float | None:
        r = self.recent_rewards
        return sum(r) / len(r) if r else None
