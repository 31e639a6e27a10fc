"""The rollout API: what a rollout author writes against.

A rollout is ``async def rollout(row, ctx: RolloutContext) -> list[Episode]`` named by
import path in ``producer.rollout``; :func:`episodes` runs one coroutine per episode, and
:class:`Trajectory` folds successive engine calls into one token-native episode. The
contract's types are in :mod:`~streamer.rollout.contract`, the fold in
:mod:`~streamer.rollout.trajectory`, the batching of concurrent calls on an in-process
model in :mod:`~streamer.rollout.batching`, and two multi-turn example tasks on the demo
model in :mod:`~streamer.rollout.tasks`.
"""

from streamer.rollout.contract import (
    Completion,
    Episode,
    RewardFn,
    Rollout,
    RolloutContext,
    Sampler,
    Segment,
    Task,
    episodes,
)
from streamer.rollout.trajectory import PrefixMismatch, Trajectory

__all__ = [
    "Completion",
    "Episode",
    "PrefixMismatch",
    "RewardFn",
    "Rollout",
    "RolloutContext",
    "Sampler",
    "Segment",
    "Task",
    "Trajectory",
    "episodes",
]
