"""Build a producer's (or the evaluator's) parts from the run config.

A :class:`Task` is what turns rows into rewards: the rows, the renderer (tokenizer +
chat template + stop ids) and the reward function. The sampler is built separately:
producers and the evaluator share the construction of a remote one. The rollout is a
function named by import path, or a rollout service's URL.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from producers import envs, rewards
from producers.dataset import check_required, load_rows
from producers.mix import training_label, training_rows
from producers.render import Renderer, stop_ids
from producers.rollout_service import MAX_REPLY_BYTES, remote
from producers.samplers import LocalSampler
from streamer import models
from streamer.config import RunConfig
from streamer.imports import load_function
from streamer.rollout.contract import DEFAULT_ROLLOUT, Rollout, Task

__all__ = [
    "Task",
    "build",
    "eval_sampler",
    "load_reward",
    "load_rollout",
    "load_task",
    "local_sampler",
    "remote_sampler",
]

log = logging.getLogger(__name__)


def load_task(
    cfg: RunConfig,
    *,
    dataset: str,
    split: str = "train",
    tokenizer=None,
    extra_stop_ids=(),
    rows: Sequence[dict] | None = None,
    reward_fn=None,
) -> Task:
    """Rows of ``dataset``, rendered with the model's tokenizer, scored by the reward (those
    given are not loaded again)."""
    rows = rows if rows is not None else load_rows(dataset, split=split, cache_dir=cfg.dataset_cache_dir)
    path = rewards.default_path(cfg.producer.reward, dataset)
    reward_fn = reward_fn or load_reward(cfg, path)
    tokenizer = tokenizer if tokenizer is not None else models.load_tokenizer(cfg.model)
    renderer = Renderer(tokenizer, chat_template=cfg.model.chat_template, extra_stop_ids=extra_stop_ids)
    return Task(rows=rows, renderer=renderer, reward_fn=reward_fn, reward_path=path)


def load_reward(cfg: RunConfig, path: str):
    """The reward function ``path`` names; "judge" is the built-in judge of ``[reward.judge]``,
    "math" and "reasoning_gym" are :mod:`producers.envs`' rewards."""
    if path == "judge":
        from producers.judge import Judge  # aiohttp and httpx: ~0.17 s of imports a run without

        return Judge(cfg.reward.judge, concurrency=cfg.reward.concurrency)
    if path in envs.REWARDS:
        return envs.load_reward(path)
    return rewards.load(path)


def load_rollout(path: str, *, max_reply_bytes: int = MAX_REPLY_BYTES, timeout: float = 0.0) -> Rollout:
    """The rollout at import path ``path`` ("" = the built-in single turn), a rollout
    service's URL (:func:`producers.rollout_service.remote`, with its reply limits), or
    ``verifiers:ENV_ID``, a verifiers environment (:mod:`producers.envs`)."""
    if path.startswith(("http://", "https://")):
        return remote(path, timeout=timeout, max_reply_bytes=max_reply_bytes)
    if path.startswith(envs.ROLLOUT_PREFIX):
        return envs.rollout(path)
    return load_function(path or DEFAULT_ROLLOUT, what="rollout")


def local_sampler(cfg: RunConfig, tokenizer) -> tuple[LocalSampler, list[int]]:
    """The initial policy (version 0, seeded by run.seed) as a sampler, and its stop ids."""
    model = models.load_model(cfg.model, seed=cfg.run.seed)
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops = stop_ids(tokenizer, extra)
    return LocalSampler(model, stop_ids=stops, pad_id=tokenizer.pad_token_id), stops


def build(cfg: RunConfig):
    """(task, sampler) of a producer, from the config."""
    p = cfg.producer
    rows = training_rows(cfg)  # first: a bad dataset or reward fails before any model loads
    dataset = training_label(cfg)
    reward_path = rewards.default_path(p.reward, dataset)
    reward_fn = load_reward(cfg, reward_path)
    if p.rollout in ("", DEFAULT_ROLLOUT):  # a rollout of the user's may score rows its own way
        required = getattr(reward_fn, "required_fields", ())
        check_required(rows, required, source=dataset, reward=reward_path)
    tokenizer = models.load_tokenizer(cfg.model)
    common = dict(dataset=dataset, tokenizer=tokenizer, rows=rows, reward_fn=reward_fn)
    if p.sampler == "local":
        if p.torch_threads:
            import torch

            torch.set_num_threads(p.torch_threads)
        sampler, stops = local_sampler(cfg, tokenizer)
        return load_task(cfg, **common, extra_stop_ids=stops), sampler
    task = load_task(cfg, **common)
    return task, remote_sampler(cfg, task.renderer.stop_ids)


def remote_sampler(cfg: RunConfig, stop_ids: list[int], *, url: str = "", model: str = ""):
    """A sampler on the producers' inference server (or on ``url``, serving ``model``), with
    the producers' engine profile, timeouts, retries and concurrency."""
    from producers import engines
    from producers.remote_sampler import RemoteSampler

    p = cfg.producer
    return RemoteSampler(
        base_url=url or p.remote_url,
        model=model or (p.remote_model if not url else "") or cfg.model.name_or_path,
        stop_ids=stop_ids,
        timeout=p.remote_timeout,
        retries=p.remote_retries,
        concurrency=p.remote_concurrency,
        engine=engines.profile(p.engine, reload_endpoint=p.reload_endpoint, lora_endpoint=p.lora_endpoint),
        max_reply_bytes=p.max_reply_bytes,
    )


def eval_sampler(cfg: RunConfig, tokenizer) -> tuple[object, list[int]]:
    """The evaluator's sampler and stop ids: its own server (``eval.remote_url``), else the
    producers' server when they sample remotely, else the initial policy in-process."""
    e = cfg.eval
    if e.remote_url or cfg.producer.sampler == "remote":
        stops = stop_ids(tokenizer)
        return remote_sampler(cfg, stops, url=e.remote_url, model=e.remote_model), stops
    return local_sampler(cfg, tokenizer)
