"""The trainer's log-probs use the sampler's temperature: on-policy importance weights are 1."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
import torch
from trainer_data import EOS, model_logprobs, prompt_ids

from consumers.batch import collate
from consumers.learner import Learner
from producers.fake_server import FakeCompletionsServer, from_sampler
from producers.remote_sampler import RemoteSampler
from producers.samplers import LocalSampler
from schemas import Sample, TrajectoryGroup
from streamer import demo
from streamer.config import ConfigError, TrainerSection, parse_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import sampled_group

T = 0.7


def _on_policy_weights(model, groups, temperature: float) -> torch.Tensor:
    """exp(prox - sampler) on the trained tokens of a fresh batch."""
    learner = Learner(model, TrainerSection(), temperature=temperature)
    batch, _ = learner.prepare(collate(groups))
    trained = batch.weights > 0
    return (batch.prox_logp - batch.sampler_logp)[trained].exp()


def _sample(sampler, prompts, *, temperature=T, top_p=1.0):
    return [
        sampled_group(
            i, p, sampler.sample(p, n=8, temperature=temperature, top_p=top_p, max_new_tokens=4, seed=i)
        )
        for i, p in enumerate(prompts)
    ]


PROMPTS = [prompt_ids(a, b) for a, b in ((1, 2), (3, 4), (7, 5))]


def test_local_sampler_on_policy_weight_is_one_at_temperature():
    model = demo.build_model(0)
    sampler = LocalSampler(model, stop_ids=[EOS])
    groups = _sample(sampler, PROMPTS)
    w = _on_policy_weights(model, groups, T)
    assert w.numel() > 20
    torch.testing.assert_close(w, torch.ones_like(w), rtol=0, atol=1e-5)
    untempered = _on_policy_weights(model, groups, 1.0)  # the bug this fixes: weights far from 1
    assert float((untempered - 1).abs().max()) > 0.05


def test_top_p_weight_is_the_nucleus_mass():
    """Documented effect of top_p < 1: every on-policy weight is <= 1 (the nucleus mass)."""
    model = demo.build_model(0)
    groups = _sample(LocalSampler(model, stop_ids=[EOS]), PROMPTS, temperature=1.0, top_p=0.5)
    w = _on_policy_weights(model, groups, 1.0)
    assert bool((w <= 1 + 1e-5).all()) and float(w.min()) < 0.99


def test_remote_sampler_processed_logprobs_match_the_trainer():
    """A server reporting processed log-probs (vLLM --logprobs-mode processed_logprobs) gives w = 1."""
    model = demo.build_model(0)
    with FakeCompletionsServer(from_sampler(LocalSampler(model, stop_ids=[EOS]))) as server:
        remote = RemoteSampler(base_url=server.url, model="demo", stop_ids=[EOS])
        try:
            groups = _sample(remote, PROMPTS)
        finally:
            remote.close()
    w = _on_policy_weights(model, groups, T)
    torch.testing.assert_close(w, torch.ones_like(w), rtol=0, atol=1e-5)


def test_remote_raw_logprobs_with_a_temperature_are_a_config_error():
    base = b'[producer]\nsampler = "remote"\nremote_url = "http://127.0.0.1:1"\n'
    with pytest.raises(ConfigError, match="logprobs-mode processed_logprobs"):
        parse_config(base + b"temperature = 0.7\n")
    with pytest.raises(ConfigError, match="producer.remote_logprobs"):
        parse_config(base + b"top_p = 0.9\n")
    assert parse_config(base + b"temperature = 1.0\n").producer.logprobs_mode == "raw"
    ok = parse_config(base + b'temperature = 0.7\nremote_logprobs = "processed"\n')
    assert ok.producer.temperature == 0.7


def test_raw_logprobs_are_the_untempered_ones():
    """What a default vLLM would report at T = 0.7 is the T = 1 log-prob: weights far from 1."""
    model = demo.build_model(0)
    groups = _sample(LocalSampler(model, stop_ids=[EOS]), PROMPTS[:1])
    raw = [
        Sample.build(
            prompt_ids=PROMPTS[0],
            completion_ids=s.completion_ids().tolist(),
            logprobs=model_logprobs(model, PROMPTS[0], s.completion_ids().tolist()),
            reward=s.reward,
            finish_reason=s.finish_reason,
            version=0,
        )
        for s in groups[0].samples
    ]
    w = _on_policy_weights(model, [_group_of(groups[0], raw)], T)
    assert float((w - 1).abs().max()) > 0.05


def _group_of(group: TrajectoryGroup, samples: list[Sample]) -> TrajectoryGroup:
    return msgspec.structs.replace(group, samples=samples)
