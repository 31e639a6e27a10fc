"""The live view of a run, read from the server like any other reader: `up` prints it.

It follows the metrics stream with a plain XREAD (no consumer group, so it takes nothing
from the exporter), and reads the version counter and the trainer group's lag.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque

from consumers.metrics_state import SeenIds
from schemas import MetricsEvent
from streamer.bus import Tail, connect, unacked
from streamer.config import RunConfig
from streamer.keys import Keys

WINDOW = 32  # rollout groups in the moving mean of reward
THRESHOLD = 0.8  # the demo's goal for the moving reward and eval accuracy


class Progress:
    def __init__(self, cfg: RunConfig, *, target_steps: int, live: bool = True, started: float | None = None):
        self.keys = Keys(cfg.run.name)
        self.client = connect(cfg.run.redis_url, socket_timeout=cfg.bus.socket_timeout)
        self.tail = Tail(self.client, self.keys.metrics, as_type=MetricsEvent)
        self.target_steps = target_steps
        self.live = live and sys.stdout.isatty()
        self.train_step = 0
        self.rewards: deque[float] = deque(maxlen=WINDOW)
        self.first_reward: float | None = None
        self.eval_acc: float | None = None
        self.eval_step = -1
        self.curve: dict[int, list[float]] = {}  # policy version -> rollout rewards
        self.eval_curve: dict[int, float] = {}
        self.groups = 0
        self.seen = SeenIds()
        self._rate: deque[tuple[float, int]] = deque(maxlen=30)
        self._last_print = 0.0
        self.started = time.monotonic() if started is None else started  # `up` began
        self.reached: dict[str, float] = {}  # "reward"/"eval" -> seconds to reach THRESHOLD

    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def update(self) -> None:
        for e in self.tail.poll(count=10_000):
            if not self.seen.add(e.id):
                continue  # a copy written by a retry
            if e.axis == "train":
                self.train_step = max(self.train_step, e.step)
            elif e.axis == "rollout":
                if (r := e.values.get("reward_mean")) is not None:
                    self.rewards.append(r)
                    if len(self.rewards) == WINDOW and self.first_reward is None:
                        self.first_reward = sum(self.rewards) / WINDOW
                    v = int(e.values.get("policy_version", -1))
                    self.curve.setdefault(v, []).append(r)
                    if len(self.rewards) == WINDOW and self.reward() >= THRESHOLD:
                        self.reached.setdefault("reward", time.monotonic() - self.started)
                self.groups += int(e.values.get("groups", 1))
            elif e.axis == "eval" and e.step >= self.eval_step:
                self.eval_step, self.eval_acc = e.step, e.values.get("accuracy")
                self.eval_curve[e.step] = self.eval_acc
                if (self.eval_acc or 0.0) >= THRESHOLD:
                    self.reached.setdefault("eval", time.monotonic() - self.started)
        self._rate.append((time.monotonic(), self.groups))

    def reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def groups_per_second(self) -> float:
        if len(self._rate) < 2:
            return 0.0
        (t0, g0), (t1, g1) = self._rate[0], self._rate[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0

    def line(self) -> str:
        reward = self.reward()
        acc = "-" if self.eval_acc is None else f"{self.eval_acc:.2f} (v{self.eval_step})"
        target = f"/{self.target_steps}" if self.target_steps else ""
        return (
            f"version {self.version():>4}  step {self.train_step:>4}{target}  "
            f"reward {'-' if reward is None else f'{reward:.2f}'}  eval acc {acc}  "
            f"{self.groups_per_second():5.1f} groups/s  lag {unacked(self.client, self.keys.traj)}"
        )

    def tick(self) -> None:
        self.update()
        now = time.monotonic()
        if self.live:
            print("\r" + self.line().ljust(100), end="", flush=True)
        elif now - self._last_print >= 10.0:
            print(self.line(), flush=True)
            self._last_print = now

    def wait_for_eval(self, version: int, timeout: float, stop: threading.Event) -> bool:
        deadline = time.monotonic() + timeout
        while self.eval_step < version and time.monotonic() < deadline and not stop.is_set():
            self.tick()
            stop.wait(0.5)
        self.update()
        return self.eval_step >= version

    def summary(self, elapsed: float, weights_dir) -> str:
        self.update()
        reward = self.reward()
        first = self.first_reward
        lines = [
            "",
            "streamer up: summary",
            f"  steps trained      {self.train_step}",
            f"  policy version     {self.version()}",
            f"  rollout reward     {_f(first)} -> {_f(reward)} (mean of the first/last {WINDOW} groups)",
            f"  eval accuracy      {_f(self.eval_acc)} (version {self.eval_step})",
            f"  reached {THRESHOLD}        reward {_t(self.reached.get('reward'))}, "
            f"eval {_t(self.reached.get('eval'))} after start",
            f"  groups published   {self.groups}",
            f"  wall time          {elapsed:.0f}s",
            f"  weights            {weights_dir}",
        ]
        return "\n".join(lines)

    def record(self, path, elapsed: float) -> None:
        """The run's curve as JSON (reward per sampling version, eval per version)."""
        data = {
            "wall_seconds": elapsed,
            "steps": self.train_step,
            "reached_seconds": self.reached,
            "reward_by_version": {v: sum(r) / len(r) for v, r in sorted(self.curve.items())},
            "groups_by_version": {v: len(r) for v, r in sorted(self.curve.items())},
            "eval_accuracy_by_version": dict(sorted(self.eval_curve.items())),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))


def _t(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f}s"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
