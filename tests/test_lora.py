"""LoRA: the trainer trains and publishes the adapter only; samplers and checkpoints load it."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from trainer_data import EOS, make_group

from consumers import checkpoint
from consumers.batch import collate
from consumers.learner import Learner
from producers.fake_server import FakeCompletionsServer, canned
from producers.remote_sampler import RemoteSampler
from producers.samplers import LocalSampler
from streamer import demo, lora, weights
from streamer.config import ConfigError, LoraSection, TrainerSection, parse_config

LORA = LoraSection(rank=4, alpha=8.0)


def _learner(seed=0):
    model = lora.apply(demo.build_model(seed), LORA)
    return Learner(model, TrainerSection(lr=1e-2))


def _batch(model, seed=0):
    rng = random.Random(seed)
    return collate([make_group(rng, model=model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(2)])


@torch.no_grad()
def _logits(model, ids):
    return model.eval()(input_ids=ids).logits


def test_only_the_adapter_trains():
    learner = _learner()
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}
    assert adapter and all("lora_" in n for n, p in learner.model.named_parameters() if p.requires_grad)
    for _ in range(2):
        learner.train_step(_batch(demo.build_model(0)))
    params = dict(learner.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in base.items()), "a frozen base weight moved"
    assert any(not torch.equal(params[n], t) for n, t in adapter.items())
    assert len(learner.optimizer.state) == len(adapter)  # optimizer state for the adapter only


def test_published_adapter_is_peft_layout_and_samplers_apply_it(tmp_path):
    learner = _learner()
    learner.train_step(_batch(demo.build_model(0)))
    _, sha = weights.write_version(learner.publishable, tmp_path, 1)
    vdir = weights.version_dir(tmp_path, 1)
    names = sorted(p.name for p in vdir.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", weights.MANIFEST]  # PEFT layout
    assert weights.check_manifest(vdir, sha)  # producers verify an adapter like full weights
    full = sum(p.numel() * 4 for p in demo.build_model(0).parameters())
    assert (vdir / "adapter_model.safetensors").stat().st_size < full / 4  # a tiny model: small gain

    sampler = LocalSampler(demo.build_model(0), stop_ids=[EOS])  # the same base, as producers load it
    sampler.load_weights(vdir)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(_logits(sampler.model, ids), _logits(learner.model, ids))
    learner.model.train()
    learner.train_step(_batch(demo.build_model(0), seed=1))  # a second version: swapped in place
    weights.write_version(learner.publishable, tmp_path, 2)
    wrapped = sampler.model
    sampler.load_weights(weights.version_dir(tmp_path, 2))
    assert sampler.model is wrapped
    torch.testing.assert_close(_logits(sampler.model, ids), _logits(learner.model, ids))
    assert sampler.sample([1, 2, 3], n=2, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)


def test_checkpoint_holds_adapter_and_optimizer(tmp_path):
    learner = _learner()
    learner.train_step(_batch(demo.build_model(0)))
    meta = checkpoint.save(
        tmp_path,
        model=learner.publishable,
        optimizer_state=learner.optimizer.state_dict(),
        step=1,
        version=1,
        parent=None,
        covered=checkpoint.Covered("1-0", [], []),
    )
    files = sorted(p.name for p in (tmp_path / meta.name / "model").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    fresh = _learner()
    path, found = checkpoint.latest(tmp_path)
    checkpoint.restore(path, found, model=fresh.model, optimizer=fresh.optimizer)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(_logits(fresh.model, ids), _logits(learner.model, ids))
    a = next(iter(learner.optimizer.state.values()))["exp_avg"]
    b = next(iter(fresh.optimizer.state.values()))["exp_avg"]
    torch.testing.assert_close(a, b)


def test_an_adapter_for_a_model_without_lora_is_a_clear_error(tmp_path):
    learner = _learner()
    weights.write_version(learner.publishable, tmp_path, 0)
    with pytest.raises(weights.WeightsError, match="model.lora"):
        weights.load_into(demo.build_model(0), weights.version_dir(tmp_path, 0))


def test_remote_sampler_loads_adapters_by_name(tmp_path):
    with FakeCompletionsServer(canned([5, EOS])) as server:
        remote = RemoteSampler(base_url=server.url, model="base", stop_ids=[EOS])
        try:
            for v in range(3):
                vdir = tmp_path / f"v{v:08d}"
                vdir.mkdir()
                (vdir / lora.ADAPTER_CONFIG).write_text('{"r": 4}')
                remote.load_weights(vdir)
                remote.sample([1, 2], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)
        finally:
            remote.close()
    assert [b["model"] for b in server.bodies] == [
        "streamer-v00000000",
        "streamer-v00000001",
        "streamer-v00000002",
    ]
    assert server.adapters == {  # two versions kept: requests in flight may still name the older
        "streamer-v00000001": str(tmp_path / "v00000001"),
        "streamer-v00000002": str(tmp_path / "v00000002"),
    }
    assert server.reloads == []


def test_lora_config():
    cfg = parse_config(b'[model.lora]\nrank = 16\nalpha = 32\ntarget_modules = ["q_proj", "v_proj"]\n')
    assert cfg.model.lora.rank == 16 and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        parse_config(b"[model.lora]\nrank = 4\ndropout = 1.5\n")
    with pytest.raises(ConfigError, match="model.lora.rnk"):
        parse_config(b"[model.lora]\nrnk = 4\n")


def test_trainer_publishes_and_checkpoints_the_adapter(redis_url, keys, client, tmp_path):
    from trainer_data import publish

    from consumers import trainer
    from streamer.config import RunConfig, replace

    rng = random.Random(3)
    publish(client, keys.traj, [make_group(rng, version=0) for _ in range(4)])
    run = {"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)}
    cfg = replace(
        RunConfig(),
        run=run,
        model={"lora": LORA},
        trainer={"groups_per_step": 2, "lr": 1e-2, "max_staleness": 4, "steps": 2, "checkpoint_every": 2},
    )

    def run_trainer():
        learner = Learner(lora.apply(demo.build_model(0), cfg.model.lora), cfg.trainer)
        return trainer.Trainer(cfg, client, keys, learner, stop=threading.Event())

    first = run_trainer()
    assert first.run() == 0
    published = sorted(cfg.weights_dir.iterdir())
    assert published and all(lora.is_adapter(d) for d in published)
    path, meta = checkpoint.latest(cfg.checkpoint_dir)
    assert lora.is_adapter(path / "model") and meta.step == 2
    again = run_trainer()
    again._restore()  # a restart restores the adapter and its optimizer state
    ids = torch.tensor([[2, 7, 1, 8]])
    torch.testing.assert_close(_logits(again.learner.model, ids), _logits(first.learner.model, ids))
