"""Samplers: the local sampler's log-probs are the sampling distribution's; the remote
sampler, against a server speaking vLLM's completions format, returns the same
structures; retries, timeouts and the concurrency limit hold."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from producers.fake_server import FakeCompletionsServer, canned, from_sampler
from producers.remote_sampler import RemoteSampler, parse_completions
from producers.render import Renderer
from producers.samplers import Completion, LocalSampler, SamplerError
from streamer import demo, weights
from streamer.errors import WeightsError

EOS = 5


@pytest.fixture(scope="module")
def tok():
    return demo.tokenizer()


@pytest.fixture(scope="module")
def prompt(tok):
    return Renderer(tok).render({"prompt": "3+4="})


@pytest.fixture
def local(tok):
    return LocalSampler(demo.build_model(0), stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)


def _teacher_forced(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :] / temperature  # (T, V)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_local_completions_end_at_eos_with_the_models_logprobs(local, prompt):
    got = local.sample(prompt, n=8, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=1)
    assert len(got) == 8 and {c.finish_reason for c in got} <= {"stop", "length"}
    for c in got:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 6 and EOS not in c.token_ids
        expected = _teacher_forced(local.model, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
    assert any(c.finish_reason == "stop" for c in got) and any(c.finish_reason == "length" for c in got)


def test_temperature_and_top_p_report_the_distribution_sampled_from(local, prompt):
    hot = local.sample(prompt, n=4, temperature=0.5, top_p=1.0, max_new_tokens=4, seed=2)
    for c in hot:
        expected = _teacher_forced(local.model, prompt, c.token_ids, temperature=0.5)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
    nucleus = local.sample(prompt, n=4, temperature=1.0, top_p=0.5, max_new_tokens=4, seed=2)
    for c in nucleus:  # renormalised over the nucleus: never below the plain log-prob
        plain = _teacher_forced(local.model, prompt, c.token_ids)
        assert (torch.tensor(c.logprobs) >= plain - 1e-5).all()


def test_seeded_sampling_repeats_and_greedy_batches_match_single_prompts(local, tok):
    r = Renderer(tok)
    prompts = [r.render({"prompt": f"{a}+{a}="}) for a in range(5)] + [r.render({"prompt": "12+3="})]
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=5)
    assert local.sample(prompts[0], seed=7, **kw) == local.sample(prompts[0], seed=7, **kw)
    batched = local.sample_many(prompts, n=1, temperature=0, max_new_tokens=5)
    for p, b in zip(prompts, batched):
        single = local.sample(p, n=1, temperature=0, top_p=1.0, max_new_tokens=5)[0]
        assert b[0].token_ids == single.token_ids
        assert b[0].logprobs == pytest.approx(single.logprobs, abs=1e-4)


def test_remote_returns_what_local_returns(local, prompt):
    with FakeCompletionsServer(from_sampler(local)) as server:
        remote = RemoteSampler(base_url=server.url, model="demo", stop_ids=[EOS])
        kw = dict(n=4, temperature=0, top_p=1.0, max_new_tokens=6)
        assert remote.sample(prompt, **kw) == local.sample(prompt, **kw)  # greedy: identical
        sampled = remote.sample(prompt, n=4, temperature=1.0, top_p=1.0, max_new_tokens=6)
        assert all(type(c) is Completion and len(c.token_ids) == len(c.logprobs) for c in sampled)
        body = server.bodies[0]
        assert body["prompt"] == prompt and body["n"] == 4 and body["logprobs"] == 1
        assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
        assert body["stop_token_ids"] == [EOS] and body["max_tokens"] == 6
        remote.close()


def test_token_ids_from_token_id_strings_when_the_server_has_no_token_ids_field():
    with FakeCompletionsServer(canned([9, 10, EOS, 3]), token_ids_field=False) as server:
        remote = RemoteSampler(base_url=server.url, model="m", stop_ids=[EOS])
        got = remote.sample([1, 2], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4)
        assert got == [Completion([9, 10, EOS], [-0.5] * 3, "stop")] * 2  # cut after EOS
        remote.close()
    with pytest.raises(SamplerError, match="no token ids"):
        parse_completions(
            {"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": [0.0]}}]}, n=1, stop_ids=[EOS]
        )
    with pytest.raises(SamplerError, match="asked for 2 completions, got 1"):
        parse_completions(
            {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [0.0]}}]}, n=2, stop_ids=[EOS]
        )


def test_retries_are_bounded_and_only_for_transient_errors():
    with FakeCompletionsServer(canned([4, EOS])) as server:
        remote = RemoteSampler(base_url=server.url, model="m", stop_ids=[EOS], retries=2, backoff=0.01)
        server.fail_next(2, 503)
        assert remote.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)[0].token_ids == [4, EOS]
        assert server.requests == 3
        server.fail_next(3, 500)
        with pytest.raises(SamplerError, match="HTTP 500.*after 3 attempts") as outage:
            remote.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)
        assert not outage.value.refused, "an engine outage is not the row's failed attempt"
        server.fail_next(1, 400)
        before = server.requests
        with pytest.raises(SamplerError, match="HTTP 400.*after 1 attempts") as refused:
            remote.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)
        assert server.requests == before + 1  # a client error is not retried
        assert refused.value.refused, "the engine refused this request: the row's failure"
        remote.close()


def test_a_slow_server_times_out():
    with FakeCompletionsServer(canned([4, EOS]), latency=1.0) as server:
        remote = RemoteSampler(
            base_url=server.url, model="m", stop_ids=[EOS], timeout=0.2, retries=1, backoff=0.01
        )
        with pytest.raises(SamplerError, match="Timeout.*after 2 attempts"):
            remote.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)
        remote.close()


def test_concurrency_is_limited():
    with FakeCompletionsServer(canned([4, EOS])) as server:
        server.hold.clear()  # requests wait: two must be in flight together, not by luck
        remote = RemoteSampler(base_url=server.url, model="m", stop_ids=[EOS], concurrency=2)
        threads = [
            threading.Thread(
                target=remote.sample,
                args=([1],),
                kwargs=dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=2),
            )
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.in_flight < 2:
            assert time.monotonic() < deadline, f"{server.in_flight} requests in flight after 30 s"
            time.sleep(0.01)
        server.hold.set()
        for t in threads:
            t.join(timeout=30)
        assert server.requests == 6 and server.max_in_flight == 2
        remote.close()


def test_new_weights_reach_the_server_and_the_local_model(tmp_path, local, prompt):
    with FakeCompletionsServer(canned([4, EOS])) as server:
        remote = RemoteSampler(base_url=server.url, model="m", stop_ids=[EOS])
        remote.load_weights(tmp_path / "v00000001")
        assert server.reloads == [str(tmp_path / "v00000001")]
        remote.close()
    uri, _ = weights.write_version(demo.build_model(seed=5), tmp_path, 1)
    before = local.sample(prompt, n=1, temperature=0, top_p=1.0, max_new_tokens=4)
    local.load_weights(weights.version_dir(tmp_path, 1))
    after = local.sample(prompt, n=1, temperature=0, top_p=1.0, max_new_tokens=4)
    assert after[0].logprobs != before[0].logprobs


def test_weights_that_do_not_fit_change_nothing(tmp_path, local, prompt):
    from transformers import AutoModelForCausalLM

    config = demo.model_config()
    config.hidden_size, config.intermediate_size = 32, 64
    weights.write_version(AutoModelForCausalLM.from_config(config), tmp_path, 2)
    before = local.sample(prompt, n=1, temperature=0, top_p=1.0, max_new_tokens=4)
    with pytest.raises(WeightsError, match=r"is F32\[18, 32\], the model's torch.float32\[18, 64\]"):
        local.load_weights(weights.version_dir(tmp_path, 2))
    assert local.sample(prompt, n=1, temperature=0, top_p=1.0, max_new_tokens=4) == before
