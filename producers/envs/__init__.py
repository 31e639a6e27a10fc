"""Environments from other libraries, each turned on by name in the config.

- ``producer.reward = "math"``: math answers graded with math-verify (:mod:`.math_reward`).
- ``producer.dataset = "reasoning_gym:NAME"`` (or ``--task reasoning_gym:NAME``): a
  reasoning-gym task's rows, scored by its own ``score_answer`` (:mod:`.gym_tasks`).
- ``producer.rollout = "verifiers:ENV_ID"``: a verifiers environment as the rollout, its
  rubric as the reward, its model calls sampled through the producer's proxy
  (:mod:`.verifiers_rollout`).

Their packages are the ``envs`` extra (``pip install 'streamer-rl[envs]'``). Nothing here
imports them until a config names one; a missing one is a :class:`ConfigError` naming the
extra.
"""

from __future__ import annotations

from producers.envs.needs import EXTRA, GYM_PREFIX, REWARDS, ROLLOUT_PREFIX, need
from streamer.errors import ConfigError

__all__ = ["EXTRA", "GYM_PREFIX", "REWARDS", "ROLLOUT_PREFIX", "need"]


def is_source(source: str) -> bool:
    """Whether dataset ``source`` names an environment's rows."""
    return source.startswith((GYM_PREFIX, ROLLOUT_PREFIX))


def rows(source: str, split: str = "train") -> list[dict]:
    """The rows of ``reasoning_gym:NAME`` or ``verifiers:ENV_ID`` (``split``: train or eval)."""
    if source.startswith(GYM_PREFIX):
        from producers.envs import gym_tasks

        return gym_tasks.rows(source.removeprefix(GYM_PREFIX), split)
    from producers.envs import verifiers_rollout

    return verifiers_rollout.rows(source.removeprefix(ROLLOUT_PREFIX), split)


def rollout(path: str):
    """The rollout ``verifiers:ENV_ID`` names."""
    from producers.envs import verifiers_rollout

    return verifiers_rollout.rollout(path.removeprefix(ROLLOUT_PREFIX))


def load_reward(name: str):
    """The reward function of a built-in reward name (one of :data:`REWARDS`)."""
    if name == "math":
        from producers.envs import math_reward

        return math_reward.load()
    if name == "reasoning_gym":
        from producers.envs import gym_tasks

        return gym_tasks.load_reward()
    raise ConfigError(f"unknown reward name {name!r}; names: {', '.join(REWARDS)}")
