"""Evaluate a rollout function greedily on held-out rows (the evaluator's multi-turn path).

Single-turn tasks are evaluated by the evaluator's batched greedy pass. A task with its
own rollout (``producer.rollout``: multi-turn, tools) can only be scored by running it:
each row is one greedy episode (G = 1, temperature 0), all rows concurrently, their engine
calls batched into few ``sample_many`` calls by a :class:`MicroBatcher`. A row whose
rollout raises or returns nothing counts as reward 0.
"""

from __future__ import annotations

import functools
import logging

import anyio

from streamer.batching import MicroBatcher
from streamer.rollout_types import Episode, Rollout, RolloutContext, Task

log = logging.getLogger(__name__)


def evaluate(
    rows: list[dict], *, task: Task, sampler, rollout: Rollout, max_new_tokens: int
) -> list[Episode | None]:
    """One greedy episode per row (None where the rollout failed)."""

    async def run_batch(prompts, **kwargs):
        call = functools.partial(sampler.sample_many, prompts, **kwargs)
        out = await anyio.to_thread.run_sync(call)
        return [[_stamped(c) for c in cs] for cs in out]

    batcher = MicroBatcher(run_batch)
    ctx = RolloutContext(
        task=task,
        group_size=1,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        seed=0,
        sample_fn=batcher.sample,
    )
    out: list[Episode | None] = [None] * len(rows)

    async def one(i: int, row: dict) -> None:
        try:
            episodes = list(await rollout(row, ctx))
        except Exception as e:  # a user function: the row scores 0, the evaluation goes on
            log.warning("eval row %d: rollout raised %s: %s (counted as 0)", i, type(e).__name__, e)
            return
        out[i] = episodes[0] if episodes else None

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i, row in enumerate(rows):
                tg.start_soon(one, i, row)

    anyio.run(main)
    return out


def _stamped(c):
    import dataclasses

    return dataclasses.replace(c, version=0) if c.version is None else c
