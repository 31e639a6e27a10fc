"""Trajectory groups for trainer tests: demo-task prompts, seeded, without a producer.

Completions are a digit then ``<|end|>`` (finish "stop") or digits without it ("length");
log-probs are the demo model's own when a model is given, else seeded random values.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import torch
from samples import group

from consumers import losses
from consumers.batch import Batch
from schemas import Sample, TrajectoryGroup
from streamer import demo
from streamer.bus import entry, entry_event
from streamer.config import write_toml

DIGITS = [demo.tokenizer().convert_tokens_to_ids(c) for c in "0123456789"]
EOS = demo.tokenizer().eos_token_id


def prompt_ids(a: int, b: int) -> list[int]:
    msgs = [{"role": "user", "content": f"{a}+{b}="}]
    ids = demo.tokenizer().apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@torch.no_grad()
def model_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    picked = logp.gather(-1, targets[:, None])[:, 0]
    return picked[len(prompt) - 1 :].tolist()


def make_sample(
    rng: random.Random, *, version: int, reward: float, finish: str = "stop", model=None, prompt=None
) -> Sample:
    prompt = prompt or prompt_ids(rng.randrange(10), rng.randrange(10))
    if finish == "length":
        completion = [rng.choice(DIGITS) for _ in range(3)]
    else:
        completion = [rng.choice(DIGITS) for _ in range(rng.randint(1, 2))] + [EOS]
    if model is not None:
        logprobs = model_logprobs(model, prompt, completion)
    else:
        logprobs = [-rng.uniform(0.1, 3.0) for _ in completion]
    return Sample.build(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        reward=reward,
        finish_reason=finish,
        version=version,
    )


def make_group(
    rng: random.Random,
    *,
    version: int = 0,
    rewards=(1.0, 0.0, 0.0, 1.0),
    finishes=None,
    model=None,
    group_id: str | None = None,
    row: int = 0,
) -> TrajectoryGroup:
    a, b = rng.randrange(10), rng.randrange(10)
    prompt = prompt_ids(a, b)
    finishes = finishes or ["stop"] * len(rewards)
    samples = [
        make_sample(rng, version=version, reward=r, finish=f, model=model, prompt=prompt)
        for r, f in zip(rewards, finishes)
    ]
    group_id = group_id or uuid.UUID(int=rng.getrandbits(128)).hex
    return group(samples, group_id=group_id, row=row, producer_id="test", created_at=0.0)


def loss_on(name: str, logp, *, adv, prox=None, sampler=None, weights=None, ref_logp=None, **kw):
    """Loss ``name`` of (B, T) tensors made by hand: proximal log-probs 0 and the sampler's
    equal to them unless given, every token trained; ``kw`` are policy_loss's keywords
    (``agg``, ``kl_coef``, ``denom``) and the loss's parameters."""
    prox = torch.zeros_like(logp) if prox is None else prox
    ids = torch.zeros(logp.shape[0], logp.shape[1] + 1, dtype=torch.int64)  # targets: unused here
    mb = Batch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        weights=torch.ones_like(logp) if weights is None else weights,
        sampler_logp=prox.clone() if sampler is None else sampler,
        advantages=torch.tensor(adv, dtype=torch.float32),
        prox_logp=prox,
        ref_logp=ref_logp,
    )
    keywords = {k: kw.pop(k) for k in ("agg", "kl_coef", "denom") if k in kw}
    return losses.policy_loss(name, logp, mb, params=kw, **keywords)


def publish(client, stream: str, groups) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for g in groups:
        pipe.xadd(stream, entry(g))
    return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]


# ---------------------------------------------------------------- trainer processes

REPO = Path(__file__).resolve().parent.parent


def write_config(path: Path, sections: dict[str, dict]) -> Path:
    """A TOML run config from {section: {key: value}}."""
    return write_toml(path, sections)


def trainer_config(tmp_path: Path, run: str, **sections: dict) -> Path:
    """``tmp_path/run.toml`` for run ``run`` with its data in ``tmp_path/data``: a trainer at
    lr 1e-3 that checkpoints every 2 steps and keeps 2 versions, then ``sections``' keys."""
    tree = {"run": {"name": run, "data_dir": str(tmp_path / "data")}}
    tree["trainer"] = {"lr": 1e-3, "checkpoint_every": 2, "keep_versions": 2}
    for name, fields in sections.items():
        tree[name] = {**tree.get(name, {}), **fields}
    return write_config(tmp_path / "run.toml", tree)


def start_trainer(config: Path, url: str, log: Path) -> subprocess.Popen:
    """`python -m streamer train` as a child process, logging to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "streamer", "train", "--config", str(config), "--redis-url", url],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def policy_versions(client, stream: str) -> list[tuple[int, int]]:
    """(version, step) of every WeightSync on the policy stream, oldest first."""
    from schemas import WeightSync

    return [(e.version, e.step) for e in (entry_event(f, WeightSync) for _, f in client.xrange(stream))]
