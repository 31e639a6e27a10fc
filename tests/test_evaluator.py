"""Evaluator: greedy scores of the current version, every k-th new version, skipping
ahead when behind; `streamer eval` stops on SIGTERM with exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bounds import START
from waits import Watch, wait_until

from producers.components import load_task, local_sampler
from producers.evaluator import Evaluator
from schemas import MetricsEvent, WeightSync, decode, encode
from schemas.metric_names import EVAL
from streamer import demo, models, weights
from streamer.config import RunConfig, replace

ROOT = Path(__file__).resolve().parents[1]


def _cfg(keys, redis_url, tmp_path, **ev) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        eval={"max_rows": 8, "batch_size": 5, "max_new_tokens": 3, **ev},
    )


def _evaluator(cfg, client, reward_fn=None) -> Evaluator:
    tok = models.load_tokenizer(cfg.model)
    sampler, stops = local_sampler(cfg, tok)
    task = load_task(cfg, dataset="demo", split="eval", tokenizer=tok, extra_stop_ids=stops)
    if reward_fn is not None:
        from producers.components import Task

        task = Task(rows=task.rows, renderer=task.renderer, reward_fn=reward_fn, reward_path="test")
    return Evaluator(cfg, client=client, task=task, sampler=sampler)


def _events(client, keys) -> list[MetricsEvent]:
    return [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]


def _steps(client, keys) -> list[int]:
    return [e.step for e in _events(client, keys)]


def _sync(client, keys, cfg, version: int, *, seed: int | None = None, sha: str | None = None) -> None:
    uri, digest = weights.write_version(
        demo.build_model(seed=version if seed is None else seed), cfg.weights_dir, version
    )
    event = WeightSync(version=version, step=version, uri=uri, sha256=sha or digest)
    client.xadd(keys.policy, {b"d": encode(event)})


def test_initial_weights_are_evaluated_as_version_0(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path, max_versions=1)
    ev = _evaluator(cfg, client)
    assert ev.run() == 0
    (event,) = _events(client, keys)
    assert event.axis == "eval" and event.step == 0 and event.source == "eval"
    assert event.eval_set == "default" and event.values["k"] == 1 == event.values["samples"]
    assert set(event.values) == set(EVAL) and event.values["rows"] == 8
    # the demo reward is 0/1: reward mean and accuracy agree; recompute by hand
    (default,) = ev.sets
    rows, prompts = default.spec.rows, default.prompts
    got = [ev.sampler.sample(p, n=1, temperature=0, top_p=1.0, max_new_tokens=3)[0] for p in prompts]
    expected = sum(demo.reward(r, default.task.renderer.decode(c.token_ids)) for r, c in zip(rows, got)) / 8
    assert event.values["accuracy"] == pytest.approx(expected) == event.values["reward_mean"]
    assert event.values["pass_at_k"] == event.values["mean_at_k"] == event.values["accuracy"]  # greedy
    assert event.values["response_length_mean"] == pytest.approx(sum(len(c.token_ids) for c in got) / 8)


def test_every_kth_version_and_skipping_ahead(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path, eval_every=2)
    for v in (1, 2, 3):
        _sync(client, keys, cfg, v)
    ev = _evaluator(cfg, client)
    ev.start()  # the newest version at start, eligible or not
    assert ev.evaluated == [3] and ev.follower.version == 3
    assert ev.step() is None  # nothing new
    for v in (4, 5, 6, 7, 8, 9):
        _sync(client, keys, cfg, v)
    assert ev.step() == 8  # behind: only the newest eligible one (4 and 6 skipped)
    _sync(client, keys, cfg, 10, sha="0" * 64)  # cannot be loaded: skipped, logged
    assert ev.step() is None and ev.follower.errors == 1
    _sync(client, keys, cfg, 11)
    _sync(client, keys, cfg, 12)
    assert ev.step() == 12
    assert [e.step for e in _events(client, keys)] == [3, 8, 12]


def test_a_failing_reward_counts_as_zero(client, keys, redis_url, tmp_path):
    def broken(row, text, sample):
        raise RuntimeError("grader down")

    ev = _evaluator(_cfg(keys, redis_url, tmp_path, max_versions=1), client, reward_fn=broken)
    assert ev.run() == 0
    assert _events(client, keys)[0].values["reward_mean"] == 0.0


@pytest.mark.slow
def test_streamer_eval_follows_versions_and_stops_on_sigterm(client, keys, redis_url, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nname = "{keys.run}"\nredis_url = "{redis_url}"\ndata_dir = "{tmp_path}"\n'
        "[eval]\nmax_rows = 10\nmax_new_tokens = 3\neval_every = 1\n[producer]\ntorch_threads = 1\n"
        "[bus]\nblock_seconds = 0.5\nsocket_timeout = 5.0\n"
    )
    with open(tmp_path / "eval.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamer", "eval", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    cfg = replace(RunConfig(), run={"name": keys.run, "data_dir": str(tmp_path)})
    try:
        _wait_for(lambda: _steps(client, keys) == [0], START, "version 0 evaluated", tmp_path, proc)
        _sync(client, keys, cfg, 1)
        _wait_for(lambda: _steps(client, keys) == [0, 1], 60, "version 1 evaluated", tmp_path, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_for(cond, timeout, what, tmp_path, proc):
    """Until ``cond``; fail with the log tail on timeout, or at once if ``proc`` exited."""
    wait_until(cond, timeout=timeout, what=what, watch=Watch(proc, log=tmp_path / "eval.log"), interval=0.1)
