"""`streamer eval`: score policy versions on a held-out set, greedily, off the trainer's path.

The evaluator follows ``…:policy`` with a plain XREAD (it owns nothing the trainer waits
for). At start it evaluates the weights of the newest version (or the initial weights,
version 0, when there is none yet); after that every version with
``version % eval.eval_every == 0``. When versions arrive faster than it evaluates it
skips ahead: of everything new it evaluates only the newest eligible version.

An evaluation renders ``eval.dataset`` (``"demo"`` = the demo's eval split) with the same
renderer and reward function as the producers, decodes greedily in batches of
``eval.batch_size`` and publishes ``MetricsEvent(axis="eval", step=version,
source="eval")`` with the names of ``schemas.metric_names.EVAL``. A reward that raises
counts as 0 for that row. Stops on SIGTERM/SIGINT (exit 0), or after
``eval.max_versions`` evaluations when that is set.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from producers import rollout as rollouts
from producers.components import load_task, local_sampler
from producers.dataset import DatasetError
from producers.follow import WeightFollower
from producers.rewards import score
from schemas import MetricsEvent, WeightSync
from streamer import lifecycle, models, rollout_eval
from streamer.bus import Publisher
from streamer.config import RunConfig
from streamer.connection import connect, retrying
from streamer.keys import Keys
from streamer.rollout_types import Task

log = logging.getLogger(__name__)

SOURCE = "eval"


class Evaluator:
    def __init__(
        self, cfg: RunConfig, *, client: redis.Redis, task: Task, sampler, stop: threading.Event | None = None
    ):
        self.cfg, self.eval_cfg, self.client, self.task, self.sampler = cfg, cfg.eval, client, task, sampler
        self.keys = Keys(cfg.run.name)
        self.stop = stop or threading.Event()
        self.rows = task.rows[: self.eval_cfg.max_rows] if self.eval_cfg.max_rows else task.rows
        self.prompts = [_render(task, row, i) for i, row in enumerate(self.rows)]
        self.follower = WeightFollower(
            client,
            self.keys,
            weights_dir=cfg.weights_dir,
            sampler=sampler,
            verify=cfg.weights.verify,
            who="evaluator",
        )
        self.publisher = Publisher(client, self.keys, cfg.bus)
        self.evaluated: list[int] = []  # versions evaluated, in order

    def run(self) -> int:
        """Evaluate the current version, then each eligible new one, until stopped."""
        log.info(
            "evaluating %d rows every %d versions (reward %s)",
            len(self.rows),
            self.eval_cfg.eval_every,
            self.task.reward_path,
        )
        retrying(self.start, what="evaluator")  # server outages: logged backoff
        while not self.stop.is_set() and not self._done():
            retrying(lambda: self.step(block=self.cfg.bus.block_seconds), what="evaluator")
        return 0

    def start(self) -> None:
        """Evaluate the newest version's weights (or the initial ones, version 0)."""
        sync = self.follower.tail.latest()  # also moves the cursor: only newer ones follow
        if sync is None or self.follower.load(sync):
            self.evaluate(self.follower.version)

    def step(self, *, block: float = 0.0) -> int | None:
        """Read what is new; evaluate the newest eligible version. Returns it, or None."""
        syncs = self._drain(block)
        eligible = [
            s for s in syncs if s.version % self.eval_cfg.eval_every == 0 and s.version > self._last()
        ]
        for sync in sorted(eligible, key=lambda s: s.version, reverse=True):
            if self.follower.load(sync):  # the newest that loads; older ones are skipped
                skipped = len(eligible) - 1
                if skipped:
                    log.info("behind: evaluating version %d, skipping %d older ones", sync.version, skipped)
                return self.evaluate(sync.version)
        return None

    def evaluate(self, version: int) -> int | None:
        """Greedy pass over the eval rows with the loaded weights; publishes the metrics."""
        start = time.monotonic()
        scored = self._run_rollouts() if self.cfg.producer.rollout else self._greedy(version)
        if scored is None:
            return None
        rewards, lengths, successes = scored
        n = len(rewards)
        values = {
            "reward_mean": sum(rewards) / n,
            "accuracy": sum(successes) / n,
            "response_length_mean": sum(lengths) / n,
            "rows": float(n),
            "eval_seconds": time.monotonic() - start,
        }
        event = MetricsEvent(axis="eval", step=version, values=values, source=SOURCE)
        retrying(lambda: self.publisher.publish(self.keys.metrics, event), what="publishing eval metrics")
        self.evaluated.append(version)
        log.info(
            "version %d: accuracy %.3f, reward %.3f over %d rows (%.1fs)",
            version,
            values["accuracy"],
            values["reward_mean"],
            n,
            values["eval_seconds"],
        )
        return version

    def _greedy(self, version: int) -> tuple[list[float], list[int], list[bool]] | None:
        """Single-turn: batched greedy completions of the rendered rows, then the reward."""
        rewards, lengths = [], []
        for lo in range(0, len(self.prompts), self.eval_cfg.batch_size):
            if self.stop.is_set():
                log.info("stopped during the evaluation of version %d; nothing published", version)
                return None
            batch = self.sampler.sample_many(
                self.prompts[lo : lo + self.eval_cfg.batch_size],
                n=1,
                temperature=0,
                max_new_tokens=self.eval_cfg.max_new_tokens,
            )
            for row, (completion,) in zip(self.rows[lo:], batch):
                rewards.append(self._reward(row, completion))
                lengths.append(len(completion.token_ids))
        return rewards, lengths, [r > 0 for r in rewards]

    def _run_rollouts(self) -> tuple[list[float], list[int], list[bool]]:
        """The task's own rollout, one greedy episode per row (multi-turn, tools); success is
        the episode's ``metrics["success"]`` when it reports one, else reward > 0."""
        episodes = rollout_eval.evaluate(
            self.rows,
            task=self.task,
            sampler=self.sampler,
            rollout=rollouts.load(self.cfg.producer.rollout),
            max_new_tokens=self.eval_cfg.max_new_tokens,
        )
        rewards = [e.reward if e is not None else 0.0 for e in episodes]
        lengths = [len(e.tokens) - len(e.segments[0].tokens) if e is not None else 0 for e in episodes]
        successes = [e is not None and e.metrics.get("success", float(e.reward > 0)) > 0 for e in episodes]
        return rewards, lengths, successes

    def _reward(self, row: dict, completion) -> float:
        try:
            text = self.task.renderer.decode(completion.token_ids)
            return score(self.task.reward_fn, row, text, completion)
        except Exception as e:  # a user function: count the row as 0, keep evaluating
            log.warning("reward %s raised %s: %s (counted as 0)", self.task.reward_path, type(e).__name__, e)
            return 0.0

    def _drain(self, block: float) -> list[WeightSync]:
        out = self.follower.tail.poll(block=block)
        while out and len(batch := self.follower.tail.poll()) > 0:
            out.extend(batch)
        return out

    def _last(self) -> int:
        return self.evaluated[-1] if self.evaluated else -1

    def _done(self) -> bool:
        return bool(self.eval_cfg.max_versions) and len(self.evaluated) >= self.eval_cfg.max_versions


def _render(task: Task, row: dict, index: int) -> list[int]:
    try:
        return task.renderer.render(row)
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"eval row {index} cannot be rendered: {e}") from None


def main(cfg: RunConfig, args) -> int:
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="eval")
    tokenizer = models.load_tokenizer(cfg.model)
    sampler, stops = local_sampler(cfg, tokenizer)
    task = load_task(cfg, dataset=cfg.eval.dataset, split="eval", tokenizer=tokenizer, extra_stop_ids=stops)
    evaluator = Evaluator(cfg, client=client, task=task, sampler=sampler)

    lifecycle.on_stop_signals(evaluator.stop, "evaluator")
    try:
        return evaluator.run()
    finally:
        client.close()
