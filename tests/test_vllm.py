"""The vLLM engine profile against a real vLLM server (its CPU build, in its own virtualenv).

One server for the module, started on a free 127.0.0.1 port in a process group of its own
and called ready once it completed a request (streamer/vllm_server.py). It serves the demo
model in the shape vLLM's CPU attention accepts (demo.save_for_engine: head size 64,
untied), 512 positions long, in 32-token KV blocks. Skipped where `python3 dev.py vllm` has not built the virtualenv; a failure
under CI, which builds it.
"""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import pytest
import torch
from needs import need
from trainer_data import model_logprobs, prompt_ids
from waits import wait_until

from consumers.batch import collate
from consumers.learner import Learner
from producers import engines
from producers.follow import WeightFollower
from producers.reload import ServerVersions, server_id
from producers.remote_sampler import RemoteSampler
from schemas import TrajectoryGroup, WeightSync
from streamer import demo, lora, vllm_server, weights
from streamer.bus import entry
from streamer.config import LoraSection, TrainerSection, replace
from streamer.server import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import sampled_group

pytestmark = pytest.mark.slow

LORA = LoraSection(rank=4, alpha=8.0)
TOL = 1e-4
POSITIONS = 512  # long enough for the in-flight tests' prompts and completions
PROMPTS = [prompt_ids(a, b) for a, b in ((1, 2), (3, 4), (7, 2), (0, 5))]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    need(vllm_server.python() is not None, "no vLLM virtualenv (python3 dev.py vllm)")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = demo.save_for_engine(root / "model", seed=0, positions=POSITIONS)
    server = vllm_server.VllmServer(
        model_dir, log_path=root / "vllm.log", port=free_port(), lora_rank=LORA.rank, max_model_len=POSITIONS
    )
    server.start()
    try:
        server.wait_ready(PROMPTS[0], timeout=400)
        yield server
    finally:
        server.stop()


def _sampler(vllm, **kwargs) -> RemoteSampler:
    eos = demo.tokenizer().eos_token_id
    return RemoteSampler(
        base_url=vllm.url, model=str(vllm.model_dir), stop_ids=[eos], engine=engines.Vllm(), **kwargs
    )


def _model(seed: int):
    return demo.build_model(seed, **demo.ENGINE_SIZE, tie=False, positions=POSITIONS).eval()


def _max_error(sampler: RemoteSampler, model, *, n: int = 4) -> float:
    """Largest |engine log-prob - local forward pass log-prob| over sampled tokens."""
    worst = 0.0
    for prompt in PROMPTS:
        for c in sampler.sample(prompt, n=n, temperature=1.0, top_p=1.0, max_new_tokens=4):
            assert c.token_ids and all(0 <= t < len(demo.tokenizer()) for t in c.token_ids)
            local = model_logprobs(model, prompt, list(c.token_ids))
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, local)))
    return worst


def test_vllm_samples_token_ids_and_logprobs_of_the_served_weights(vllm):
    sampler = _sampler(vllm)
    try:
        assert _max_error(sampler, _model(0)) <= TOL
    finally:
        sampler.close()


def test_vllm_full_weight_version_and_lora_version_reach_the_server(vllm, tmp_path, client, keys):
    """A new full-weight version (written as the trainer writes it for vLLM: untied), then a
    LoRA adapter version: after each, the engine's log-probs are the new weights'."""
    sampler = _sampler(vllm)
    follower = WeightFollower(client, keys, weights_dir=tmp_path, sampler=sampler)
    try:
        new = _model(7)
        uri, sha = weights.write_version(new, tmp_path, 1, untie=True)
        client.xadd(keys.policy, entry(WeightSync(version=1, step=1, uri=uri, sha256=sha)))
        assert follower.update() and follower.version == 1
        assert _max_error(sampler, _model(0)) > 0.01, "still the start-up weights"
        assert _max_error(sampler, new) <= TOL

        adapted = lora.apply(_model(7), LORA)
        with torch.no_grad():  # a non-zero B: the adapter changes the outputs
            for name, p in adapted.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.5)
        uri, sha = weights.write_version(lora.AdapterView(adapted), tmp_path, 2)
        client.xadd(keys.policy, entry(WeightSync(version=2, step=2, uri=uri, sha256=sha)))
        assert follower.update() and sampler.model == "streamer-v00000002"
        assert _max_error(sampler, adapted.eval()) <= TOL
    finally:
        sampler.close()
        _restore(vllm, tmp_path)


def test_vllm_mismatch_kl_on_fresh_data_is_zero(vllm):
    """The trainer's k3 KL between the engine's log-probs and its own, on groups the engine
    just sampled with the weights the trainer holds: ~0 (a different numerics path only)."""
    sampler = _sampler(vllm)
    try:
        groups = [
            sampled_group(
                i, prompt, sampler.sample(prompt, n=4, temperature=1.0, top_p=1.0, max_new_tokens=3)
            )
            for i, prompt in enumerate(PROMPTS)
        ]
        learner = Learner(_model(0), TrainerSection(lr=1e-6))
        values = learner.train_step(collate(groups))
        assert abs(values["mismatch_kl"]) < 1e-6, values["mismatch_kl"]
    finally:
        sampler.close()


def test_vllm_probe_says_ready_and_the_model_name_it_refuses(vllm):
    sampler = _sampler(vllm)
    try:
        sampler.probe(PROMPTS[0])  # ready: returns
        sampler.model = "no-such-model"
        with pytest.raises(Exception) as err:
            sampler.probe(PROMPTS[0])
        assert getattr(err.value, "refused", False) and "HTTP 404" in str(err.value), err.value
    finally:
        sampler.close()


def _served(cfg, vllm, keys, redis_url, tmp_path, producer=None, **sections):
    """``cfg`` for a run of the test's own whose producers sample from the module's vLLM
    server; ``producer`` adds to that section, ``sections`` replace others' keys."""
    return replace(
        cfg,
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        model={"name_or_path": str(vllm.model_dir)},
        producer={
            "sampler": "remote",
            "engine": "vllm",
            "remote_url": vllm.url,
            "remote_model": str(vllm.model_dir),
            **(producer or {}),
        },
        **sections,
    )


def _restore(vllm, tmp_path) -> None:
    """Put the start-up weights back for the tests after this one."""
    sampler = _sampler(vllm)
    try:
        weights.write_version(_model(0), tmp_path, 99, untie=True)
        sampler.load_weights(weights.version_dir(tmp_path, 99))
    finally:
        sampler.close()


def test_vllm_shared_by_two_producers_reloads_once_per_version(vllm, client, keys, redis_url, tmp_path):
    """Two producers on one vLLM server: one reload per version between them (the shared-reload
    protocol, producers/reload.py), and every group stamped with a version the server held."""
    from producers.components import build
    from producers.producer import Producer
    from schemas import decode
    from streamer.bus import FIELD
    from streamer.config import RunConfig

    producer = {"group_size": 2, "max_new_tokens": 2}
    cfg = _served(RunConfig(), vllm, keys, redis_url, tmp_path, producer, trainer={"groups_per_step": 1000})
    producers = []
    for pid in ("a", "b"):
        task, sampler = build(cfg)
        producers.append(Producer(cfg, client=client, producer_id=pid, task=task, sampler=sampler))
    try:
        for version in (1, 2, 3):
            uri, sha = weights.write_version(_model(version), cfg.weights_dir, version, untie=True)
            client.xadd(keys.policy, entry(WeightSync(version=version, step=version, uri=uri, sha256=sha)))
            for p in producers:
                assert p.step() == "published"
        stamps = [decode(f[FIELD], TrajectoryGroup).policy_version for _, f in client.xrange(keys.traj)]
        assert stamps == [1, 1, 2, 2, 3, 3], stamps
        assert sum(p.follower.shared.reloads for p in producers) == 3
        assert all(p.follower.version == 3 for p in producers)
        assert _max_error(producers[0].sampler, _model(3)) <= TOL
    finally:
        for p in producers:
            p.close()
        _restore(vllm, tmp_path)


def test_vllm_evaluator_samples_through_the_engine_and_scores_what_a_local_model_scores(
    vllm, client, keys, redis_url, tmp_path
):
    """The evaluator on the producers' vLLM server: greedy on the held-out rows, a new version
    reloaded into the engine first; its accuracy is what the same weights score locally."""
    from producers import eval_sets
    from producers.components import eval_sampler, load_task
    from producers.evaluator import Evaluator
    from producers.render import Renderer
    from producers.samplers import LocalSampler
    from schemas import MetricsEvent, decode
    from streamer import models

    cfg = _served(demo.config(), vllm, keys, redis_url, tmp_path, eval={"eval_every": 1, "max_new_tokens": 2})
    tokenizer = models.load_tokenizer(cfg.model)
    sampler, stops = eval_sampler(cfg, tokenizer)
    renderer = Renderer(tokenizer, chat_template=cfg.model.chat_template, extra_stop_ids=stops)
    ev = Evaluator(cfg, client=client, sampler=sampler, sets=eval_sets.prepare(cfg), renderer=renderer)
    try:
        assert not ev.in_process
        ev.start()  # version 0: the served start-up weights
        new = _model(5)
        uri, sha = weights.write_version(new, cfg.weights_dir, 1, untie=True)
        client.xadd(keys.policy, entry(WeightSync(version=1, step=1, uri=uri, sha256=sha)))
        assert ev.step() == 1
    finally:
        sampler.close()
        _restore(vllm, tmp_path)
    events = {
        e.step: e.values for e in (decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics))
    }
    task = load_task(cfg, dataset="demo", split="eval", tokenizer=tokenizer)
    for version, model in ((0, _model(0)), (1, new)):
        local = LocalSampler(model, stop_ids=[demo.tokenizer().eos_token_id])
        right = [
            demo.reward(
                row,
                tokenizer.decode(
                    local.sample(task.renderer.render(row), n=1, temperature=0, top_p=1.0, max_new_tokens=2)[
                        0
                    ].token_ids
                ),
            )
            for row in task.rows
        ]
        assert events[version]["accuracy"] == pytest.approx(sum(right) / len(right)), version


# requests in flight at a reload (producer.inflight_updates)
NEW_TOKENS = 400  # long enough for a reload to land mid-request even on a quiet machine
IN_FLIGHT = 8


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 64-token prefix (2 KV blocks), each asked four times."""
    tok = demo.tokenizer()
    usable = [i for i in range(len(tok)) if i not in (tok.eos_token_id, tok.pad_token_id)]
    rng = random.Random(0)
    prefix = [rng.choice(usable) for _ in range(64)]
    tails = [[rng.choice(usable) for _ in range(8)] for _ in range(2)]
    return [prefix + tails[i % 2] for i in range(IN_FLIGHT)]


def _tracked(server, client, keys, mode: str) -> RemoteSampler:
    sampler = RemoteSampler(
        base_url=server.url,
        model=str(server.model_dir),
        stop_ids=[],
        engine=engines.Vllm(),
        concurrency=IN_FLIGHT,
        extra_body={"min_tokens": NEW_TOKENS},  # no early EOS: every request spans the reload
    )
    versions = ServerVersions(client, keys, server.url, lock_seconds=120, mode=mode)
    client.set(keys.served(server_id(server.url)), 0)  # the start-up weights, version 0
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
def test_every_token_knows_the_version_that_sampled_it_with_requests_in_flight(
    vllm, client, keys, tmp_path, mode
):
    """Eight concurrent requests of two long completions each, on prompts that share a prefix
    of two KV blocks and repeat, with a new version loaded while they stream: every token's
    engine log-prob equals a local forward pass of the version it is stamped with, and the
    repeated prompts afterwards are the new version's (no prefix cache of the old weights)."""
    sampler = _tracked(vllm, client, keys, mode)
    old, new = 0, 1
    models = {old: _model(0), new: _model(101)}
    directory = weights.version_dir(tmp_path, new)
    weights.write_version(models[new], tmp_path, new, untie=True)
    prompts = _prompts()
    out: list = [None] * len(prompts)

    def ask(i: int) -> None:
        try:
            out[i] = sampler.sample(prompts[i], n=2, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS)
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        flights = sampler.server._flights
        # requests may end before the last one goes out (the CPU engine is fast): the reload
        # comes once one is in flight (drain) or streaming tokens (keep, abort)
        if mode == "drain":
            wait_until(lambda: flights, timeout=60, what="a request in flight")
        else:
            wait_until(
                lambda: any(f.chunks > 0 for f in list(flights.values())), timeout=60, what="tokens streaming"
            )
        sampler.server.ensure(new, lambda: sampler.reload(directory), engine=sampler)
        for t in threads:
            t.join(timeout=300)
        assert all(isinstance(o, list) for o in out), out
        seen = _check_stamps(out, prompts, models)
        spanned = sum(c.switches is not None for cs in out for c in cs)
        if mode == "drain":  # each request under one version: those in flight the old, later ones the new
            assert old in seen and spanned == 0, (seen, spanned)
        else:  # the reload landed mid-request: tokens of both versions, each stamped right
            assert seen == {old, new} and spanned > 0, (seen, spanned)
        # the same prompts again: the new version's, none of the old weights' prefix cache
        sampler.extra_body = {}
        again = [sampler.sample(p, n=2, temperature=1.0, top_p=1.0, max_new_tokens=8) for p in prompts[:2]]
        assert all(c.version == new and c.switches is None for cs in again for c in cs)
        _check_stamps_short(again, prompts[:2], models[new])
    finally:
        sampler.close()
        _restore(vllm, tmp_path)


def _check_stamps_short(completions, prompts, model) -> None:
    for prompt, cs in zip(prompts, completions, strict=True):
        for c in cs:
            local = model_logprobs(model, prompt, c.token_ids)
            assert max(abs(x - y) for x, y in zip(c.logprobs, local, strict=True)) <= TOL
