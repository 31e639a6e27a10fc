"""reasoning-gym tasks: ``producer.dataset = "reasoning_gym:NAME"`` (``--task reasoning_gym:NAME``
for a run on the demo model), scored by the task's own ``score_answer``.

reasoning-gym generates a task's items procedurally: item ``i`` of a dataset with seed ``s``
is drawn from ``Random(s + i)``, so the rows are the same on every machine and nothing is
downloaded. The train split is items ``0 .. TRAIN_ROWS - 1`` of seed :data:`TRAIN_SEED`; the
eval split :data:`EVAL_ROWS` items of seed :data:`EVAL_SEED`, a billion further on, so no item
is drawn from the same seed in both; a train item whose question an eval item also asks (a
small task space repeats itself) is dropped from the train split.

A row is the item (``question``, ``answer``, ``metadata``) plus ``messages``: the question as
one user turn. The reward (``producer.reward = "reasoning_gym"``, the default for these rows)
hands the task's ``score_answer`` the text inside the completion's last
``<answer>...</answer>`` (reasoning-gym's convention), else the whole completion, stripped; a
``score_answer`` that raises scores 0.0 (logged): it was given an answer it cannot read.
"""

from __future__ import annotations

import functools
import logging

from producers.envs.needs import GYM_PREFIX, need
from streamer.errors import ConfigError

log = logging.getLogger(__name__)

TRAIN_SEED = 0
EVAL_SEED = 10**9  # item seeds TRAIN_SEED + i and EVAL_SEED + i never meet
TRAIN_ROWS = 1000
EVAL_ROWS = 100


def rows(name: str, split: str = "train") -> list[dict]:
    """The rows of reasoning-gym task ``name``; ``split`` "eval" is the held-out part."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    held_out = _items(name, EVAL_SEED, EVAL_ROWS)
    if split == "eval":
        return [_row(item) for item in held_out]
    asked = {item["question"] for item in held_out}
    return [_row(item) for item in _items(name, TRAIN_SEED, TRAIN_ROWS) if item["question"] not in asked]


def load_reward():
    """The reward, once reasoning-gym imports (a ConfigError naming the extra otherwise)."""
    need("reasoning_gym", "reasoning-gym", what='producer.reward = "reasoning_gym"')
    return reasoning_gym_score


def reasoning_gym_score(row: dict, text: str, sample=None) -> float:
    """The row's task's ``score_answer`` of the completion's answer (see the module docstring)."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    answer = text.strip() if answer is None else answer
    task = _dataset(row["metadata"]["source_dataset"])
    try:
        return float(task.score_answer(answer, entry=row))
    except Exception as e:  # the task could not read this answer: a wrong one
        log.warning("reasoning_gym reward: score_answer raised %s: %s (0.0)", type(e).__name__, e)
        return 0.0


reasoning_gym_score.required_fields = ("answer", "metadata")


def _items(name: str, seed: int, size: int) -> list[dict]:
    _dataset(name)  # the task exists, or one clear error
    import reasoning_gym

    return list(reasoning_gym.create_dataset(name, seed=seed, size=size))


def _row(item: dict) -> dict:
    return {**item, "messages": [{"role": "user", "content": item["question"]}]}


@functools.cache
def _dataset(name: str):
    """A dataset object of task ``name``, for its ``score_answer`` (which reads the entry)."""
    need("reasoning_gym", "reasoning-gym", what=f"dataset {GYM_PREFIX}{name}")
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = [n for n in sorted(DATASETS) if name in n or n in name][:5]
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(DATASETS)} tasks)"
        raise ConfigError(f"{GYM_PREFIX}{name}: reasoning-gym has no task {name!r}{hint}")
    return reasoning_gym.create_dataset(name, seed=EVAL_SEED, size=1)
