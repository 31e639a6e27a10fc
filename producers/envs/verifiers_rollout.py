"""``producer.rollout = "verifiers:ENV_ID"``: a verifiers environment as the rollout, its
rubric as the reward, every model call sampled by the producer.

``ENV_ID`` is what verifiers calls a taskset id: an importable module (verifiers' own under
``verifiers.v1.tasksets``) whose ``__all__`` exports a ``Taskset``, and optionally the
``Harness`` its agent runs and the ``Env`` that drives an episode (a multi-turn env's
``run()`` answers the agent turn by turn; without one, verifiers plays one agent once).

An episode is verifiers' own: ``env.run_episode(task, model)`` runs the agent's harness,
whose model calls reach verifiers' interception server, which records them on the trace and
relays them to ``model.client``. That client is the producer's proxy
(:mod:`producers.proxy`), with the episode's own key: the proxy renders each call, samples
it with the run's sampler and settings, stamps it with the policy version, and folds the
calls into the episode's tokens, which are the tokens the model sampled. The reward is the
sum of the trace's rewards: the task's ``@vf.reward`` functions (and judges), weighted.

Rows: ``producer.dataset = "verifiers:ENV_ID"`` gives the taskset's tasks, each row the
task's data as JSON plus ``messages`` (its prompt as a chat, for reading). Rows of any
other dataset are read as the task's data: ``prompt`` (else ``messages``) and the fields
the task's data type declares (``answer``, ...). A taskset has no held-out split: the
``eval`` split is the same tasks.

Each agent seat runs on verifiers' local ``subprocess`` runtime unless the env pins
another (verifiers' default is a remote Prime sandbox). The G episodes of a row share one
interception server, up for the row.

What goes wrong, and what happens:

- the sampler fails (the agent saw a 502): the engine's outage, the row handed back;
- verifiers marks the episode failed (a harness or task error; the error names it):
  that episode is dropped, logged, the others kept;
- an env with a seat it marks untrainable (a simulated user) sampling through the proxy:
  the proxy would train that seat's calls too, so the rollout is rejected, with that
  reason (a seat whose ``AgentConfig.client`` names another endpoint is fine);
- a call the proxy refuses (a 400: no room under ``trainer.max_seq_len``, ``n`` above the
  proxy's limit) fails its episode: dropped, logged. verifiers' built-in program harnesses
  are programs installed over the network; :class:`~producers.envs.verifiers_harness.ChatHarness`
  runs in process and offline.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import secrets

from producers import proxy
from producers.envs.needs import ROLLOUT_PREFIX, need
from streamer.errors import ConfigError, EpisodeRejected
from streamer.rollout.contract import Episode, Rollout, RolloutContext, episodes

log = logging.getLogger(__name__)

MAX_TASKS = 100_000  # tasks read from a taskset that never ends
KEY_VARIABLE = "STREAMER_EPISODE_API_KEY_"  # verifiers reads an endpoint's key from a variable


def rollout(env_id: str) -> Rollout:
    """The rollout of verifiers environment ``env_id`` (loaded now: a bad id fails here)."""
    env = environment(env_id)
    task_type = type(env.taskset).task_type()
    data_type = task_type.data_type()
    task_config = env.taskset.config.task

    async def run(row: dict, ctx: RolloutContext) -> list[Episode]:
        task = task_type(data_type.model_validate(_data(row)), task_config)  # a row that does not fit: here

        # serving() keeps its interception server on the env: each row serves its own copy
        row_env = copy.copy(env)

        async def one(row: dict, ctx: RolloutContext, index: int) -> Episode | None:
            return await _episode(row_env, task, ctx)

        async with row_env.serving():  # the interception server the G episodes share
            return await episodes(one)(row, ctx)

    run.__name__ = run.__qualname__ = f"verifiers:{env_id}"
    return run


def rows(env_id: str, split: str = "train") -> list[dict]:
    """The taskset's tasks as rows (``split`` "eval": the same tasks, see the module docstring)."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    taskset = environment(env_id).taskset
    if not taskset.bounded:
        log.warning("verifiers:%s never ends: its first %d tasks are the rows", env_id, MAX_TASKS)
        taskset = taskset.take(MAX_TASKS)
    out = [_row(task.data) for task in taskset]
    if not out:
        raise ConfigError(f"{ROLLOUT_PREFIX}{env_id}: the taskset has no tasks")
    return out


@functools.cache
def environment(env_id: str):
    """verifiers environment ``env_id``, each seat on the local runtime unless it pins one."""
    need("verifiers.v1", "verifiers", what=f"{ROLLOUT_PREFIX}{env_id}")
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config

    _quiet_per_episode_logs()
    try:
        seats = {
            name: {"runtime": {"type": "subprocess"}}
            for name, field in env_config_type(env_id).model_fields.items()
            if isinstance(field.default, AgentConfig) and "runtime" not in field.default.model_fields_set
        }
        return load_environment(resolve_env_config({"taskset": {"id": env_id}, **seats}))
    except Exception as e:  # the module is missing, exports no taskset, or its config is bad
        raise ConfigError(f"{ROLLOUT_PREFIX}{env_id}: {type(e).__name__}: {e}") from None


async def _episode(env, task, ctx: RolloutContext) -> Episode | None:
    """One episode of ``task`` through the proxy; None when verifiers marks it failed."""
    from verifiers.v1 import ModelContext
    from verifiers.v1.clients import EvalClientConfig

    with proxy.server().session(ctx) as session, _key_variable(session.endpoint.api_key) as variable:
        client = EvalClientConfig(base_url=session.endpoint.base_url, api_key_var=variable)
        try:
            result = await env.run_episode(task, ModelContext(model=session.endpoint.model, client=client))
        finally:  # the engine's failure, not the episode's: the producer's outage path
            if session.engine_error is not None:
                raise session.engine_error
        untrainable = sorted(
            {t.agent.name or "agent" for t in result.traces if _proxied_untrained(t, client)}
        )
        if untrainable:
            raise EpisodeRejected(
                "error",
                f"verifiers does not train seat(s) {', '.join(untrainable)}, but the proxy trains "
                "every call it serves: give such a seat an endpoint of its own (AgentConfig.client)",
            )
        if not result.ok:
            error = result.last_error or next((t.last_error for t in result.traces if t.last_error), None)
            why = f"{error.type}: {error.message}" if error else "no error recorded"
            log.warning("verifiers episode of task %s failed (dropped): %s", task.data.idx, why)
            return None
        return session.episode(sum(t.reward for t in result.traces))


def _proxied_untrained(trace, client) -> bool:
    """Whether ``trace`` is of a seat verifiers does not train whose calls went to ``client``."""
    return not trace.agent.trainable and getattr(trace.agent.config, "client", None) == client


def _data(row: dict) -> dict:
    """A row as task data: its ``prompt``, else its ``messages``, and every other field."""
    data = {k: v for k, v in row.items() if k != "messages"}
    if "prompt" not in data and "messages" in row:
        data["prompt"] = row["messages"]
    return data


def _row(data) -> dict:
    """Task data as a row: its JSON, plus its prompt as ``messages`` when it has one."""
    row = data.model_dump(mode="json", exclude_defaults=True)
    prompt = row.get("prompt")
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if chat:
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        row["messages"] = system + list(chat)
    return row


@contextlib.contextmanager
def _key_variable(key: str):
    """An environment variable holding ``key``, for as long as the block runs: verifiers
    reads an endpoint's API key only from a variable it is named, and each episode has its
    own key. The ``API_KEY`` in the name keeps verifiers' runtimes from passing it on."""
    name = KEY_VARIABLE + secrets.token_hex(8)
    os.environ[name] = key
    try:
        yield name
    finally:
        os.environ.pop(name, None)


def _quiet_per_episode_logs() -> None:
    """verifiers logs several INFO lines per episode, and aiohttp and httpx one per HTTP call
    (two hops a model call); a producer runs thousands of episodes. Their warnings stay; a
    level set explicitly stays too."""
    for name in ("verifiers", "aiohttp.access", "httpx"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
