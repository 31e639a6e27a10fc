"""The built-in rollout, ``producer.rollout``'s default (:data:`streamer.rollout.contract.DEFAULT_ROLLOUT`)."""

from __future__ import annotations

from producers.rewards import score_all
from streamer.rollout.contract import Episode, RolloutContext, Segment


async def single_turn(row: dict, ctx: RolloutContext) -> list[Episode]:
    """Render -> sample G completions in one call -> reward each (the default rollout; an
    async reward is awaited for all G at once, see :mod:`producers.rewards`)."""
    task = ctx.task
    prompt = task.renderer.render(row)
    completions = [c for c in await ctx.sample(prompt, n=ctx.group_size) if c.token_ids]
    texts = [task.renderer.decode(c.token_ids) for c in completions]
    rewards = await score_all(
        task.reward_fn,
        row,
        texts,
        completions,
        name=task.reward_path,
        limiter=ctx.reward_limiter,
        timeout=ctx.reward_timeout,
    )
    return [
        Episode([Segment(prompt), *c.segments()], r, c.finish_reason)
        for c, r in zip(completions, rewards, strict=True)
        if r is not None
    ]
