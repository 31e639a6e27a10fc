"""Two multi-turn tasks beside the addition demo, on the demo's tokenizer and tiny model.

Both are rollout functions (``producer.rollout``) that run G independent episodes per row
and stitch every engine call token-exactly with :class:`streamer.rollout.trajectory.Trajectory`.
``streamer up --task NAME`` runs one. The demo vocabulary has only digits, ``+``, ``=``
and the chat specials, so the environment speaks in those.

- ``retry``: the demo's rows, but a wrong answer is not the end: the environment
  answers ``+`` ("higher") or ``=`` ("lower") as a user turn and the model tries again,
  up to :data:`RETRY_ATTEMPTS` answers. Reward 1.0 / 0.6 / 0.3 for a right answer at
  attempt 1 / 2 / 3; success is a right answer at any attempt. Held out: the demo's 10
  eval pairs (:func:`streamer.demo.held_out`). An earlier split, ``(3a + b) % 5 == 0``,
  held out both orders of some pairs (``0+5`` and ``5+0``) and ``0+0``; with it held-out
  success stayed at 0.45-0.64.
- ``tools``: ``kk=`` asks for the value of key ``kk`` in a lookup table that is drawn
  afresh for every episode (a hash of the key and the episode's seed): nothing in the
  prompt reveals it and memorising is useless (a first version with one fixed table was
  memorised: 0.61 success on train keys, 0.03 on held-out ones, no tool calls). The model
  calls the tool by answering ``=``; the tool's result comes back as a ``system`` turn
  (weight 0: the model did not sample it), and the model answers with it. Reward 1 for the
  right digit after a lookup, 0 otherwise: an answer without a lookup is not graded (a
  lucky guess, right one time in ten, would otherwise outweigh the rare early lookups
  and the policy collapses onto guessing one digit; a shaping bonus for calling was
  tried too and collapsed the digit after the call instead). Held out: keys 70-99 are
  only in the eval split.
"""

from __future__ import annotations

import hashlib

from streamer import demo
from streamer.rollout.contract import Completion, RolloutContext, episodes
from streamer.rollout.trajectory import Trajectory

TASKS = ("retry", "tools")
RETRY_ATTEMPTS = 3
RETRY_REWARDS = (1.0, 0.6, 0.3)
TOOL_CALL = "="
GYM_TASK = "reasoning_gym:"  # `--task reasoning_gym:NAME`: a reasoning-gym task (producers.envs)
GYM_NEW_TOKENS = 8  # a reasoning-gym task's completion cap on the demo model: a short answer and its stop
EVAL_KEYS = range(70, 100)


def gym_config(name: str):
    """``--task reasoning_gym:NAME``: reasoning-gym task ``name`` on the demo model, a run that
    works offline (the demo's character vocabulary cannot read the questions' words: it shows
    the plumbing, not learning). Completions may run to :data:`GYM_NEW_TOKENS` tokens; an
    unknown task is a config error when its rows are first read (producers.envs.gym_tasks)."""
    from streamer.config import replace

    source = GYM_TASK + name
    return replace(
        demo.config(),
        run={"name": f"reasoning-gym-{name}".replace("_", "-")},
        producer={"dataset": source, "reward": "", "max_new_tokens": GYM_NEW_TOKENS},
        eval={"dataset": source, "max_new_tokens": GYM_NEW_TOKENS, "max_rows": 20},
    )


def config(name: str):
    """The run config of task ``name``: the demo's, with the task's rows and rollout, and a
    learning rate of 1e-3 (the tasks' figures in the README are measured with it).
    ``reasoning_gym:NAME`` is a reasoning-gym task on the demo model (:func:`gym_config`)."""
    from streamer.config import replace

    if name.startswith(GYM_TASK):
        return gym_config(name.removeprefix(GYM_TASK))
    if name not in TASKS:
        from streamer.errors import ConfigError

        raise ConfigError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}, {GYM_TASK}NAME")
    cfg = demo.config()
    return replace(
        cfg,
        run={"name": name},
        producer={
            "dataset": f"demo:{name}",
            "rollout": f"streamer.rollout.tasks:{name}",
            "concurrency": 2,
        },
        trainer={"max_seq_len": 64, "lr": 1e-3},
        eval={"dataset": f"demo:{name}"},
    )


def rows(name: str, split: str = "train") -> list[dict]:
    """Rows of task ``name``; ``split`` "eval" is the held-out part."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    if name == "retry":  # the demo's pairs and split
        return demo.rows(split)
    if name == "tools":
        keys = [f"{k:02d}" for k in range(100) if (k in EVAL_KEYS) == (split == "eval")]
        return [{"messages": [{"role": "user", "content": f"{k}="}], "key": k} for k in keys]
    raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")


def value(key: str, table: int = 0) -> int:
    """The lookup tool: the digit of ``key`` in table ``table`` (one per episode)."""
    return hashlib.sha256(f"streamer-lookup:{table}:{key}".encode()).digest()[0] % 10


def _answer(ctx: RolloutContext, c: Completion) -> str:
    return ctx.task.renderer.decode(c.token_ids).strip()[:1]


async def _turn(t: Trajectory, ctx: RolloutContext) -> Completion:
    prompt = t.next_prompt()
    (c,) = await ctx.sample(prompt)
    t.extend(prompt, c)
    return c


@episodes
async def retry(row: dict, ctx: RolloutContext, index: int):
    """Answer; on a wrong answer hear "+" (higher) or "=" (lower) and try again."""
    t = Trajectory(ctx.task.renderer.render(row))
    target = int(row["answer"])
    for attempt in range(RETRY_ATTEMPTS):
        got = _answer(ctx, await _turn(t, ctx))
        if got == row["answer"]:
            return t.episode(RETRY_REWARDS[attempt], attempts=attempt + 1.0, success=1.0)
        if attempt + 1 < RETRY_ATTEMPTS:
            hint = "+" if not got.isdigit() or int(got) < target else "="
            t.append_messages(ctx.task.renderer, [{"role": "user", "content": hint}])
    return t.episode(0.0, attempts=float(RETRY_ATTEMPTS), success=0.0)


@episodes
async def tools(row: dict, ctx: RolloutContext, index: int):
    """Call the lookup tool (answer "="), read its result, answer with it."""
    t = Trajectory(ctx.task.renderer.render(row))
    right = str(value(row["key"], table=ctx.seed))
    got, calls = _answer(ctx, await _turn(t, ctx)), 0
    if got == TOOL_CALL:
        calls = 1
        t.append_messages(ctx.task.renderer, [{"role": "system", "content": right}])
        got = _answer(ctx, await _turn(t, ctx))
    success = float(calls == 1 and got == right)
    return t.episode(success, tool_calls=float(calls), success=success)
