"""Evaluate a rollout function on held-out rows (the evaluator's multi-turn and server path).

Single-turn sets on an in-process model are evaluated by the evaluator's batched pass.
Everything else is scored by running the set's rollout (``producers.single_turn.single_turn``
when it has none of its own): each row is one group of n episodes (G = n) at the set's
temperature, up to ``concurrency`` rows at once. On an in-process model their engine calls
are batched into few ``sample_many`` calls by a :class:`MicroBatcher`; on a server each
call is its own request, at most the sampler's ``max_parallel`` in flight. A row whose
rollout raises returns no episodes (its samples count as failures), except for an engine
that cannot be reached (a :class:`SamplerError` that is not ``refused``): that is an
outage, not a score, and the evaluation stops with it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import anyio

from streamer.errors import SamplerError
from streamer.rollout.batching import MicroBatcher
from streamer.rollout.contract import Episode, Rollout, RolloutContext, SampleFn, Task

log = logging.getLogger(__name__)


def evaluate(
    rows: list[dict],
    *,
    task: Task,
    sampler,
    rollout: Rollout,
    max_new_tokens: int,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    version: int = 0,
    concurrency: int = 0,
) -> list[list[Episode]]:
    """The episodes of each row (empty where the rollout failed), sampled by ``sampler``
    and stamped with ``version``; ``concurrency`` rows at once (0 = all)."""
    out: list[list[Episode]] = [[] for _ in rows]

    async def one(i: int, row: dict, ctx: RolloutContext, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            try:
                out[i] = list(await rollout(copy.deepcopy(row), ctx))  # every version sees the same row
            except SamplerError as e:
                if not e.refused:
                    raise  # the engine is down: nothing of this evaluation is a score
                log.warning("eval row %d: the engine refused it: %s (counted as failed)", i, e)
            except Exception as e:  # a user function: the row's samples fail, the evaluation goes on
                log.warning("eval row %d: rollout raised %s: %s (counted as failed)", i, type(e).__name__, e)

    async def main() -> None:
        ctx = RolloutContext(
            task=task,
            group_size=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            sample_fn=sample_fn(sampler, version),
        )
        limiter = anyio.CapacityLimiter(concurrency or max(1, len(rows)))
        async with anyio.create_task_group() as tg:
            for i, row in enumerate(rows):
                tg.start_soon(one, i, row, ctx.with_seed(seed * 7919 + i), limiter)

    try:
        anyio.run(main)
    except BaseExceptionGroup as group:  # the outage itself, not a group of one
        outage = group.subgroup(lambda e: isinstance(e, SamplerError))
        if outage is None:
            raise
        raise _first(outage) from group
    return out


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def sample_fn(sampler, version: int) -> SampleFn:
    """The rollouts' engine call on ``sampler`` (call it inside the event loop)."""

    def stamped(cs):
        return [dataclasses.replace(c, version=version) if c.version is None else c for c in cs]

    parallel = getattr(sampler, "max_parallel", 1)
    if parallel == 1 and hasattr(sampler, "sample_many"):

        async def run_batch(prompts, **kwargs):
            call = functools.partial(sampler.sample_many, prompts, **kwargs)
            return [stamped(cs) for cs in await anyio.to_thread.run_sync(call)]

        return MicroBatcher(run_batch).sample
    limiter = anyio.CapacityLimiter(parallel)

    async def sample(prompt_ids, **kwargs):
        call = functools.partial(sampler.sample, prompt_ids, **kwargs)
        return stamped(await anyio.to_thread.run_sync(call, limiter=limiter))

    return sample
