"""The live view of a run, read from the server like any other reader: `up` prints it.

It follows the metrics stream with a plain XREAD (no consumer group, so it takes nothing
from the exporter), folding events into a :class:`~streamer.readmodel.history.History`; a resumed
run starts from the exporter's snapshot. It reads the version counter and the trainer
group's lag.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque

from schemas import MetricsEvent
from streamer import rows
from streamer.bus import unacked
from streamer.config import RunConfig
from streamer.connection import TRANSIENT, connect
from streamer.keys import Keys
from streamer.readmodel.history import WINDOW
from streamer.readmodel.saved import Curves
from streamer.tail import Tail
from streamer.values import DataError, parse_int

log = logging.getLogger(__name__)

THRESHOLD = 0.8  # the demo's goal for the moving reward and eval accuracy


class Progress:
    def __init__(self, cfg: RunConfig, *, target_steps: int, live: bool = True, started: float | None = None):
        self.keys = Keys(cfg.run.name)
        self.producer_cfg = cfg.producer
        self.client = connect(cfg.run.redis_url, socket_timeout=cfg.bus.socket_timeout)
        self.target_steps = target_steps
        self.live = live and sys.stdout.isatty()
        # a resumed run: the exporter's snapshot, then the metrics stream after it (it is
        # trimmed behind the snapshots)
        self.curves = Curves(self.client, self.keys)
        self.history = self.curves.history
        self.tail = Tail(self.client, self.keys.metrics, as_type=MetricsEvent, last_id=self.curves.last_id)
        self._rate: deque[tuple[float, int]] = deque(maxlen=30)
        self._last_print = 0.0
        self._down = False  # the server did not answer the last tick
        self._bad_version = False  # the version key held no number (logged once)
        self.started = time.monotonic() if started is None else started  # `up` began
        self.reached: dict[str, float] = {}  # "reward"/"eval" -> seconds to reach THRESHOLD
        # the best headline eval accuracy seen: a score between two ticks counts, even when a
        # later version's came before the tick
        self.best_eval = self.history.eval_accuracy
        self.nothing_to_teach = False  # every row set aside: nothing left to teach
        self.ended = ""  # why the producers finished before the trainer's steps ("": they did not)
        self.counts = rows.RowCounts(0, 0, 0)  # the rows, when the producers finished

    @property
    def train_step(self) -> int:
        return self.history.train_step

    @property
    def eval_step(self) -> int:
        return self.history.eval_step

    @property
    def eval_acc(self) -> float | None:
        return self.history.eval_accuracy

    @property
    def groups(self) -> int:
        return self.history.groups

    def version(self) -> int | None:
        """The current policy version; None (logged once) when the version key holds no number."""
        try:
            return parse_int(self.client.get(self.keys.version), self.keys.version, default=0)
        except DataError as e:
            if not self._bad_version:
                log.warning("progress: %s", e)
            self._bad_version = True
            return None

    def update(self) -> None:
        h = self.history
        for e in self.tail.poll(count=10_000):
            if not self.curves.apply(e):
                continue  # a copy written by a retry
            if e.axis == "rollout" and e.values.get("nothing_to_teach"):
                self.nothing_to_teach = True  # a producer found nothing left to teach
            if len(h.recent_rewards) == WINDOW and (h.reward() or 0.0) >= THRESHOLD:
                self.reached.setdefault("reward", time.monotonic() - self.started)
            if (h.eval_accuracy or 0.0) >= THRESHOLD:
                self.reached.setdefault("eval", time.monotonic() - self.started)
            if h.eval_accuracy is not None and h.eval_accuracy > (self.best_eval or -1.0):
                self.best_eval = h.eval_accuracy
        self._rate.append((time.monotonic(), h.groups))

    def why_producers_stopped(self) -> str:
        """Why every producer finished, as the server says."""
        try:
            self.counts = c = rows.counts(self.client, self.keys)
        except TRANSIENT:
            return "the producers finished"
        if c.nothing_to_teach or self.nothing_to_teach:
            return (
                f"every row is set aside ({c.solved} solved, {c.unsolvable} unsolvable of {c.total}): "
                "nothing left to teach"
            )
        if c.exhausted:
            epochs = self.producer_cfg.epochs
            return f"the data is exhausted: every row of producer.epochs = {epochs} is sampled"
        if self.producer_cfg.max_groups:
            return f"the producers published producer.max_groups = {self.producer_cfg.max_groups} groups each"
        return "the producers finished"

    def way_on(self) -> str:
        """What to do about a run that trained nothing."""
        out = []
        if self.history.steps_skipped:
            out.append(
                f"{self.history.steps_skipped} steps were skipped: the gradient was not finite (trainer.log)."
            )
        c = self.counts
        if c.nothing_to_teach and c.unsolvable:
            out.append(
                "Rows set aside come back by themselves when the sampling or reward config changes, "
                "or with `streamer rows reset` (or `streamer up --reset-rows`)."
            )
        elif c.nothing_to_teach:
            out.append("Every row is solved: `streamer rows reset` brings them back.")
        elif c.exhausted:
            out.append("Raise producer.epochs to sample the rows again.")
        else:
            out.append("Every group was rejected or dead-lettered: `streamer status` says why.")
        return " ".join(out)

    def reached_eval(self, target: float | None) -> bool:
        """An evaluation scored ``target`` or above (never, for None)."""
        return target is not None and self.best_eval is not None and self.best_eval >= target

    def reward(self) -> float | None:
        return self.history.reward()

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
            f"version {_v(self.version()):>4}  step {self.train_step:>4}{target}  "
            f"reward {'-' if reward is None else f'{reward:.2f}'}  eval acc {acc}  "
            f"{self.groups_per_second():5.1f} groups/s  lag {unacked(self.client, self.keys.traj)}"
        )

    def tick(self) -> None:
        """Print the line now and then; a server outage (a restart, a cluster failover) is
        ridden out like the roles ride it out: one warning, then quiet until it answers."""
        try:
            self.update()
            now = time.monotonic()
            if self.live:
                print("\r" + self.line().ljust(100), end="", flush=True)
            elif now - self._last_print >= 10.0:
                print(self.line(), flush=True)
                self._last_print = now
        except TRANSIENT as e:
            if not self._down:
                log.warning("progress: server unavailable (%s); waiting", e)
            self._down = True
            return
        self._down = False

    def wait_for_eval(self, version: int, timeout: float, stop: threading.Event) -> bool:
        deadline = time.monotonic() + timeout
        while self.eval_step < version and time.monotonic() < deadline and not stop.is_set():
            self.tick()
            stop.wait(0.5)
        self.update()
        return self.eval_step >= version

    def summary(self, elapsed: float, weights_dir) -> str:
        self.update()
        if self.target_steps and self.train_step >= self.target_steps:
            self.ended = ""  # the trainer reached its steps as the producers finished
        reward = self.reward()
        first = self.history.first_reward
        lines = [
            "",
            "streamer up: summary",
            f"  steps trained      {self.train_step}" + self._skipped(),
            *([f"  ended              {self.ended}"] if self.ended else []),
            f"  policy version     {_v(self.version())}",
            f"  rollout reward     {_f(first)} -> {_f(reward)} (mean of the first/last {WINDOW} groups)",
            f"  eval accuracy      {_f(self.eval_acc)} (version {self.eval_step})",
            *self._other_sets(),
            f"  reached {THRESHOLD}        reward {_t(self.reached.get('reward'))}, "
            f"eval {_t(self.reached.get('eval'))} after start",
            f"  groups published   {self.groups}",
            f"  wall time          {elapsed:.0f}s",
            f"  weights            {weights_dir}",
        ]
        return "\n".join(lines)

    def _skipped(self) -> str:
        n = self.history.steps_skipped
        return f" ({n} skipped: no weights changed, gradient not finite)" if n else ""

    def _other_sets(self) -> list[str]:
        """A summary line per eval set besides the headline one: its last mean@k and pass@k."""
        out = []
        for name, c in self.history.eval_sets.items():
            mean, best = c.accuracy.means(), c.pass_at_k.means()
            if name == self.history.headline_set or not mean:
                continue
            v = max(mean)
            out.append(
                f"  eval set {name:<10}mean@{c.k} {mean[v]:.2f}, pass@{c.k} {_f(best.get(v))} (version {v})"
            )
        return out

    def record(self, path, elapsed: float) -> None:
        """The run's curve as JSON (reward per sampling version, eval per version)."""
        data = {
            "wall_seconds": elapsed,
            "steps": self.train_step,
            "reached_seconds": self.reached,
            "reward_by_version": self.history.reward_by_version.means(),
            "groups_by_version": self.history.reward_by_version.counts(),
            "eval_accuracy_by_version": self.history.eval_by_version.means(),
            "rejected_per_accepted_by_step": self.history.rejected_by_step.means(),
            "eval_sets": {
                name: {"k": c.k, "mean_at_k": c.accuracy.means(), "pass_at_k": c.pass_at_k.means()}
                for name, c in self.history.eval_sets.items()
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))


def _v(version: int | None) -> str:
    return "?" if version is None else str(version)


def _t(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f}s"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
