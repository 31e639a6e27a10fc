"""Two multi-turn tasks beside the addition demo, on the demo's tokenizer and tiny model.

Both are rollout functions (``producer.rollout``) that run G independent episodes per row
and stitch every engine call token-exactly with :class:`streamer.trajectory.Trajectory`.
``streamer up --task NAME`` runs one. The demo vocabulary has only digits, ``+``, ``=``
and the chat specials, so the environment speaks in those.

- ``retry``: ``a+b=`` as in the demo, but a wrong answer is not the end: the environment
  answers ``+`` ("higher") or ``=`` ("lower") as a user turn and the model tries again,
  up to :data:`RETRY_ATTEMPTS` answers. Reward 1.0 / 0.6 / 0.3 for a right answer at
  attempt 1 / 2 / 3; success is a right answer at any attempt. Held out: the pairs with
  ``(3a + b) % 5 == 0`` are only in the eval split.
- ``tools``: ``kk=`` asks for ``value(kk)``, a digit from a lookup table of two-digit
  keys (a seeded hash: nothing in the prompt reveals it, and held-out keys were never
  seen). The model calls the tool by answering ``=``; the tool's result comes back as a
  ``system`` turn (weight 0: the model did not sample it), and the model answers with it.
  Reward 1 for the right digit. Held out: keys 70-99 are only in the eval split, so only
  calling the tool, not memorising the table, succeeds there.
"""

from __future__ import annotations

import hashlib

from streamer import demo
from streamer.rollout_types import Completion, RolloutContext, episodes
from streamer.trajectory import Trajectory

TASKS = ("retry", "tools")
RETRY_ATTEMPTS = 3
RETRY_REWARDS = (1.0, 0.6, 0.3)
TOOL_CALL = "="
EVAL_KEYS = range(70, 100)


def config(name: str):
    """The run config of task ``name``: the demo's, with the task's rows and rollout."""
    from streamer.config import replace

    if name not in TASKS:
        from streamer.errors import ConfigError

        raise ConfigError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    cfg = demo.config()
    return replace(
        cfg,
        run={"name": name},
        producer={
            "dataset": f"demo:{name}",
            "rollout": f"streamer.tasks:{name}",
            "concurrency": 2,
            "max_seq_len": 64,
        },
        eval={"dataset": f"demo:{name}"},
    )


def rows(name: str, split: str = "train") -> list[dict]:
    """Rows of task ``name``; ``split`` "eval" is the held-out part."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    held_out = split == "eval"
    if name == "retry":
        return [
            {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(10)
            for b in range(10)
            if a + b <= 9 and ((3 * a + b) % 5 == 0) == held_out
        ]
    if name == "tools":
        keys = [f"{k:02d}" for k in range(100) if (k in EVAL_KEYS) == held_out]
        return [{"messages": [{"role": "user", "content": f"{k}="}], "key": k} for k in keys]
    raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")


def value(key: str) -> int:
    """The lookup tool: a digit per key that nothing in the prompt reveals."""
    return hashlib.sha256(f"streamer-lookup:{key}".encode()).digest()[0] % 10


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
            return t.episode(RETRY_REWARDS[attempt], attempts=attempt + 1.0)
        if attempt + 1 < RETRY_ATTEMPTS:
            hint = "+" if not got.isdigit() or int(got) < target else "="
            t.append_messages(ctx.task.renderer, [{"role": "user", "content": hint}])
    return t.episode(0.0, attempts=float(RETRY_ATTEMPTS))


@episodes
async def tools(row: dict, ctx: RolloutContext, index: int):
    """Call the lookup tool (answer "="), read its result, answer with it."""
    t = Trajectory(ctx.task.renderer.render(row))
    got, calls = _answer(ctx, await _turn(t, ctx)), 0
    if got == TOOL_CALL:
        calls = 1
        result = str(value(row["key"]))
        t.append_messages(ctx.task.renderer, [{"role": "system", "content": result}])
        got = _answer(ctx, await _turn(t, ctx))
    right = str(value(row["key"]))
    return t.episode(1.0 if got == right else 0.0, tool_calls=float(calls))
