"""`streamer eval`: score policy versions on held-out eval sets, off the trainer's path.

The evaluator follows ``…:policy`` with a plain XREAD (it owns nothing the trainer waits
for). At start it evaluates the weights of the newest version (or the initial weights,
version 0, when there is none yet); after that every version with
``version % eval.eval_every == 0``. When versions arrive faster than it evaluates it
skips ahead: of everything new it evaluates only the newest eligible version.

An evaluation scores every eval set (:mod:`producers.eval_sets`: the ``[eval]`` keys are
the set ``default``, greedy; ``[eval.sets.NAME]`` add sets with k samples per row at a
temperature, their own rollout and reward) and publishes one ``MetricsEvent(axis="eval",
step=version, source="eval", eval_set=NAME)`` per set with the names of
``schemas.metric_names.EVAL`` (pass@k, mean@k, ...). Single-turn sets on an in-process
model decode in batches of ``eval.batch_size`` prompts; the others run their rollout
(:mod:`producers.eval_rollouts`). A reward that raises counts as a failed sample (reward 0).

Where it samples: a server of its own (``eval.remote_url``, which it reloads itself, so
each evaluation sees exactly the version it names), else the producers' server when they
sample remotely (it joins their one-reload-per-version protocol, :mod:`producers.reload`;
a reload by a producer during an evaluation moves the server on, and the event names the
version the server confirmed when the evaluation began), else the model in-process.
Stops on SIGTERM/SIGINT (exit 0), or after ``eval.max_versions`` evaluations when set.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import zlib
from dataclasses import dataclass

import anyio
import redis

from producers import eval_rollouts, eval_sets, rewards
from producers.components import eval_sampler, load_rollout
from producers.dataset import DatasetError
from producers.eval_sets import EvalSet, RowScores, summarize
from producers.follow import WeightFollower
from producers.render import Renderer
from producers.rewards import score
from producers.samplers import SamplerError
from schemas import MetricsEvent, WeightSync
from streamer import lifecycle, models
from streamer.bus import Publisher
from streamer.config import RunConfig
from streamer.config_rollout import DEFAULT_SET
from streamer.connection import connect, retrying
from streamer.errors import EpisodeRejected, RewardUnavailable
from streamer.keys import Keys
from streamer.rollout.contract import Rollout, Task

log = logging.getLogger(__name__)

SOURCE = "eval"


@dataclass(frozen=True)
class _Prepared:
    spec: EvalSet
    task: Task
    prompts: list[list[int]]  # rendered rows of a single-turn set (empty otherwise)
    rollout: Rollout


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        client: redis.Redis,
        sampler,
        task: Task | None = None,
        sets: list[EvalSet] | None = None,
        renderer=None,
        stop: threading.Event | None = None,
    ):
        """Scores ``sets`` (rendered with ``renderer``), or only the default set of ``task``."""
        self.cfg, self.eval_cfg, self.client, self.sampler = cfg, cfg.eval, client, sampler
        self.keys = Keys(cfg.run.name)
        self.stop = stop or threading.Event()
        if sets is None:
            sets, renderer = [_default_set(cfg, task)], task.renderer
        self.sets = [_prepare(s, renderer) for s in sets]
        self.in_process = getattr(sampler, "max_parallel", 1) == 1 and hasattr(sampler, "sample_many")
        self.follower = WeightFollower.of_run(cfg, client, sampler, who="evaluator")
        self.publisher = Publisher(client, self.keys, cfg.bus)
        self.evaluated: list[int] = []  # versions evaluated, in order

    def run(self) -> int:
        """Evaluate the current version, then each eligible new one, until stopped."""
        log.info(
            "evaluating every %d versions: %s", self.eval_cfg.eval_every, "; ".join(map(_describe, self.sets))
        )
        retrying(self.start, what="evaluator")  # server outages: logged backoff
        while not self.stop.is_set() and not self._done():
            retrying(lambda: self.step(block=self.cfg.bus.block_seconds), what="evaluator")
        return 0

    def start(self) -> None:
        """Evaluate the newest version's weights (or the initial ones, version 0)."""
        sync = self.follower.tail.latest()  # also moves the cursor: only newer ones follow
        if sync is None or self._wait_out_engine(lambda: self.follower.load(sync), "loading weights"):
            self.evaluate(self.follower.version)

    def step(self, *, block: float = 0.0) -> int | None:
        """Read what is new; evaluate the newest eligible version. Returns it, or None."""
        syncs = self._drain(block)
        eligible = [
            s for s in syncs if s.version % self.eval_cfg.eval_every == 0 and s.version > self._last()
        ]
        for sync in sorted(eligible, key=lambda s: s.version, reverse=True):
            loaded = self._wait_out_engine(functools.partial(self.follower.load, sync), "loading weights")
            if loaded:  # the newest that loads; older ones are skipped
                skipped = len(eligible) - 1
                if skipped:
                    log.info("behind: evaluating version %d, skipping %d older ones", sync.version, skipped)
                return self.evaluate(self.follower.version)  # a shared server may be past sync
        return None

    def evaluate(self, version: int) -> int | None:
        """Score every set with the loaded weights; one metrics event per set."""
        for s in self.sets:
            start = time.monotonic()
            scores = self._wait_out_engine(functools.partial(self._score, s, version), f"set {s.spec.name}")
            if scores is None:
                log.info(
                    "stopped during the evaluation of version %d: set %s not published", version, s.spec.name
                )
                return None
            values = summarize(scores, n=s.spec.n, k=s.spec.k)
            values["eval_seconds"] = time.monotonic() - start
            event = MetricsEvent(
                axis="eval", step=version, values=values, source=SOURCE, eval_set=s.spec.name
            )
            publish = functools.partial(self.publisher.publish, self.keys.metrics, event)
            retrying(publish, what="publishing eval metrics")
            log.info(
                "version %d, set %s: accuracy %.3f, pass@%d %.3f, reward %.3f over %d rows (%.1fs)",
                version,
                s.spec.name,
                values["accuracy"],
                s.spec.k,
                values["pass_at_k"],
                values["reward_mean"],
                len(scores),
                values["eval_seconds"],
            )
        self.evaluated.append(version)
        return version

    def _score(self, s: _Prepared, version: int) -> list[RowScores] | None:
        if s.spec.single_turn and self.in_process:
            return self._batched(s, version)
        spec = s.spec
        episodes = eval_rollouts.evaluate(
            spec.rows,
            task=s.task,
            sampler=self.sampler,
            rollout=s.rollout,
            max_new_tokens=spec.max_new_tokens,
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=self._seed(spec, version) or 0,
            version=version,
            concurrency=self.eval_cfg.batch_size,
        )
        if episodes is not None:
            _say_other_versions(episodes, version, spec.name)
        return [
            RowScores(
                rewards=[e.reward for e in eps],
                successes=[e.metrics.get("success", float(e.reward > 0)) > 0 for e in eps],
                lengths=[len(e.tokens) - len(e.segments[0].tokens) for e in eps],
            )
            for eps in episodes
        ]

    def _batched(self, s: _Prepared, version: int) -> list[RowScores] | None:
        """Single-turn on an in-process model: batched completions of the rendered rows."""
        spec, size, out = s.spec, self.eval_cfg.batch_size, []
        for lo in range(0, len(s.prompts), size):
            if self.stop.is_set():
                return None
            batch = self.sampler.sample_many(
                s.prompts[lo : lo + size],
                n=spec.n,
                temperature=spec.temperature,
                top_p=spec.top_p,
                max_new_tokens=spec.max_new_tokens,
                seed=self._seed(spec, version, lo),
            )
            for row, completions in zip(spec.rows[lo:], batch):
                rewards = self._rewards(s.task, row, completions)
                lengths = [len(c.token_ids) for c in completions]
                out.append(RowScores(rewards, [r > 0 for r in rewards], lengths))
        return out

    def _wait_out_engine(self, fn, what: str):
        """``fn()``, again and again while the engine cannot be reached (an outage is never a
        score); None once stopped. An engine that refuses (4xx) raises."""
        delay = 0.5
        while not self.stop.is_set():
            try:
                return fn()
            except SamplerError as e:
                if e.refused:
                    raise
                log.warning("%s: engine unreachable (%s); trying again in %.1fs", what, e, delay)
                self.stop.wait(delay)
                delay = min(2 * delay, 30.0)
        return None

    def _seed(self, spec: EvalSet, version: int, batch: int = 0) -> int | None:
        """None when greedy; else fixed by the run's seed, the set, the version and the batch."""
        if spec.temperature == 0:
            return None
        return zlib.crc32(f"{self.cfg.run.seed}:{spec.name}:{version}:{batch}".encode())

    def _rewards(self, task: Task, row: dict, completions) -> list[float]:
        """The reward of each completion; an async reward (a judge) is awaited for all at once,
        and its outage (RewardUnavailable) is waited out like the engine's, never scored."""
        if not rewards.is_async(task.reward_fn):
            return [self._reward(task, row, c) for c in completions]
        texts = [task.renderer.decode(c.token_ids) for c in completions]

        async def call() -> list[float | None]:
            try:
                return await rewards.score_all(
                    task.reward_fn,
                    row,
                    texts,
                    completions,
                    name=task.reward_path,
                    timeout=self.cfg.reward.timeout,
                )
            finally:  # this loop ends here: so does what the reward holds in it (a judge's client)
                await rewards.close(task.reward_fn)

        try:
            try:
                scored = anyio.run(call)
            except BaseExceptionGroup as group:  # the first failure, as the producer reads it
                raise group.exceptions[0] from None
        except (EpisodeRejected, RewardUnavailable) as e:  # a bad reply, or the row refused
            if isinstance(e, RewardUnavailable) and not e.refused:
                raise  # an outage: waited out
            log.warning("reward %s: %s (counted as 0)", task.reward_path, e)
            return [0.0] * len(completions)
        return [0.0 if r is None else r for r in scored]

    def _reward(self, task: Task, row: dict, completion) -> float:
        try:
            text = task.renderer.decode(completion.token_ids)
            return score(task.reward_fn, row, text, completion)
        except Exception as e:  # a user function: count the sample as 0, keep evaluating
            log.warning("reward %s raised %s: %s (counted as 0)", task.reward_path, type(e).__name__, e)
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


def _default_set(cfg: RunConfig, task: Task) -> EvalSet:
    """The set of the [eval] keys over ``task``'s rows (as the evaluator had before sets)."""
    e = cfg.eval
    return EvalSet(
        name=DEFAULT_SET,
        rows=task.rows[: e.max_rows] if e.max_rows else task.rows,
        reward_fn=task.reward_fn,
        reward_path=task.reward_path,
        rollout=cfg.producer.rollout,
        k=1,
        n=1,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=e.max_new_tokens,
    )


def _prepare(spec: EvalSet, renderer) -> _Prepared:
    task = Task(rows=spec.rows, renderer=renderer, reward_fn=spec.reward_fn, reward_path=spec.reward_path)
    prompts = (
        [_render(spec.name, task, row, i) for i, row in enumerate(spec.rows)] if spec.single_turn else []
    )
    return _Prepared(spec, task, prompts, load_rollout(spec.rollout))


def _describe(s: _Prepared) -> str:
    spec = s.spec
    how = "greedy" if spec.temperature == 0 else f"pass@{spec.k} of {spec.n} at T={spec.temperature}"
    return f"{spec.name} ({len(spec.rows)} rows, {how}, reward {spec.reward_path})"


def _render(name: str, task: Task, row: dict, index: int) -> list[int]:
    try:
        return task.renderer.render(row)
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"eval set {name!r}: row {index} cannot be rendered: {e}") from None


def main(cfg: RunConfig, args) -> int:
    sets = eval_sets.prepare(cfg)  # first: a bad set fails before any model loads
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="eval")
    tokenizer = models.load_tokenizer(cfg.model)
    sampler, stops = eval_sampler(cfg, tokenizer)
    renderer = Renderer(tokenizer, chat_template=cfg.model.chat_template, extra_stop_ids=stops)
    evaluator = Evaluator(cfg, client=client, sampler=sampler, sets=sets, renderer=renderer)

    lifecycle.on_stop_signals(evaluator.stop, "evaluator")
    try:
        return evaluator.run()
    finally:
        sampler.close()
        client.close()


def _say_other_versions(episodes, version: int, name: str) -> None:
    """Warn when tokens of an evaluation of ``version`` were sampled by other versions: a
    server shared with producers moved on during it (the score mixes both)."""
    tokens, other = 0, {}
    for eps in episodes:
        for e in eps:
            for seg in e.segments:
                if seg.sampled:
                    tokens += len(seg.tokens)
                    if seg.version != version:
                        other[seg.version] = other.get(seg.version, 0) + len(seg.tokens)
    if other:
        log.warning(
            "version %d, set %s: %d of %d sampled tokens came from version(s) %s (the shared server "
            "moved on during the evaluation): its score mixes them",
            version,
            name,
            sum(other.values()),
            tokens,
            ", ".join(map(str, sorted(other))),
        )
