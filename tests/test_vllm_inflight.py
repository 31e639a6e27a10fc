"""Reloads that land while requests are in flight, against a real vLLM server (its CPU build).

Eight concurrent requests of two long completions each, on prompts that share a prefix of
several KV blocks (``--block-size 32``) and repeat, with a new version loaded while they
stream. For each ``producer.inflight_updates`` mode every token's engine log-prob must equal
a local forward pass of the version it is stamped with, and the repeated prompts afterwards
must be the new version's (no prefix cache of the old weights). Skipped where
`python3 dev.py vllm` has not built the virtualenv; a failure under CI, which builds it.
"""

from __future__ import annotations

import random
import threading

import pytest
from needs import need
from trainer_data import model_logprobs
from waits import wait_until

from producers import engines
from producers.reload import ServerVersions, server_id
from producers.remote_sampler import RemoteSampler
from streamer import demo, vllm_server, weights
from streamer.server import free_port

pytestmark = pytest.mark.slow

TOL = 1e-4
POSITIONS = 512
NEW_TOKENS = 160  # long enough for a reload to land mid-request
CONCURRENCY = 8


def _model(seed: int):
    return demo.build_model(seed, **demo.ENGINE_SIZE, tie=False, positions=POSITIONS).eval()


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 64-token prefix (2 KV blocks), each asked four times."""
    tok = demo.tokenizer()
    usable = [i for i in range(len(tok)) if i not in (tok.eos_token_id, tok.pad_token_id)]
    rng = random.Random(0)
    prefix = [rng.choice(usable) for _ in range(64)]
    tails = [[rng.choice(usable) for _ in range(8)] for _ in range(2)]
    return [prefix + tails[i % 2] for i in range(CONCURRENCY)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    need(vllm_server.python() is not None, "no vLLM virtualenv (python3 dev.py vllm)")
    root = tmp_path_factory.mktemp("vllm-inflight")
    model_dir = demo.save_for_engine(root / "model", seed=0, positions=POSITIONS)
    server = vllm_server.VllmServer(
        model_dir, log_path=root / "vllm.log", port=free_port(), max_model_len=POSITIONS, block_size=32
    )
    server.start()
    try:
        server.wait_ready(_prompts()[0], timeout=400)
        yield {"server": server, "version": 0, "models": {0: _model(0)}, "root": root}
    finally:
        server.stop()


def _sampler(engine, client, keys, mode: str) -> RemoteSampler:
    server = engine["server"]
    sampler = RemoteSampler(
        base_url=server.url,
        model=str(server.model_dir),
        stop_ids=[],
        engine=engines.Vllm(),
        concurrency=CONCURRENCY,
        extra_body={"min_tokens": NEW_TOKENS},  # no early EOS: every request spans the reload
    )
    versions = ServerVersions(client, keys, server.url, lock_seconds=120, mode=mode)
    client.set(keys.served(server_id(server.url)), engine["version"])  # what it serves now
    sampler.attach(versions)
    return sampler


def _check_stamps(completions, prompts, models) -> set[int]:
    """Every token's engine log-prob against its stamped version's; the versions seen."""
    seen = set()
    for prompt, cs in zip(prompts, completions, strict=True):
        for c in cs:
            assert len(c.token_ids) == NEW_TOKENS or c.finish_reason == "stop"
            for a, b, v in c.runs():
                seen.add(v)
                local = model_logprobs(models[v], prompt + c.token_ids[:a], c.token_ids[a:b])
                worst = max(abs(x - y) for x, y in zip(c.logprobs[a:b], local, strict=True))
                assert worst <= TOL, f"tokens [{a}, {b}) stamped v{v} are off by {worst:.3g} nats"
    return seen


@pytest.mark.parametrize("mode", ["drain", "keep", "abort"])
def test_every_token_knows_the_version_that_sampled_it(engine, client, keys, mode):
    sampler = _sampler(engine, client, keys, mode)
    old, new = engine["version"], engine["version"] + 1
    engine["models"][new] = _model(100 + new)
    directory = weights.version_dir(engine["root"], new)
    weights.write_version(engine["models"][new], engine["root"], new, untie=True)
    prompts = _prompts()
    out: list = [None] * len(prompts)

    def ask(i: int) -> None:
        out[i] = sampler.sample(prompts[i], n=2, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        flights = sampler.server._flights
        wait_until(lambda: len(flights) == len(prompts), timeout=60, what="every request in flight")
        if mode != "drain":  # tokens are streaming in
            wait_until(
                lambda: all(f.chunks > 0 for f in list(flights.values())),
                timeout=60,
                what="tokens streaming",
            )
        sampler.server.ensure(new, lambda: sampler.reload(directory), engine=sampler)
        for t in threads:
            t.join(timeout=300)
        assert all(o is not None for o in out), "a request never came back"
        seen = _check_stamps(out, prompts, engine["models"])
        engine["version"] = new
        spanned = sum(c.switches is not None for cs in out for c in cs)
        if mode == "drain":  # each request under one version: the one it started with
            assert seen == {old} and spanned == 0
        else:  # the reload landed mid-request: tokens of both versions, each stamped right
            assert seen == {old, new} and spanned > 0, (seen, spanned)
        # the same prompts again: the new version's, none of the old weights' prefix cache
        sampler.extra_body = {}
        again = [sampler.sample(p, n=2, temperature=1.0, top_p=1.0, max_new_tokens=8) for p in prompts[:2]]
        assert all(c.version == new and c.switches is None for cs in again for c in cs)
        _check_stamps_short(again, prompts[:2], engine["models"][new])
    finally:
        sampler.close()


def _check_stamps_short(completions, prompts, model) -> None:
    for prompt, cs in zip(prompts, completions, strict=True):
        for c in cs:
            local = model_logprobs(model, prompt, c.token_ids)
            assert max(abs(x - y) for x, y in zip(c.logprobs, local, strict=True)) <= TOL
