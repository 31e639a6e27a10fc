"""Weight-sync events that must not be loaded: a uri outside the configured weights directory
(absolute elsewhere, `..`, percent-encoded `..`, a symlink out, a relative path, another
scheme) or a wrong sha256. A producer and the evaluator each reject every one, log it,
count it (the producer's rollout metric ``weight_load_errors``) and keep the weights they
have; the next good version loads. The outside directory holds valid weights with the
right sha256: the location alone must be enough to refuse it.

A process that cannot load the versions it is told about does not sample an old one for
ever: after producers.follow.MAX_LOAD_FAILURES failed loads in a row it stops with one
line naming the file and the reason, and `streamer status` names it.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from harness import report

from producers.components import build, load_task, local_sampler
from producers.evaluator import Evaluator
from producers.producer import Producer
from schemas import MetricsEvent, TrajectoryGroup, WeightSync, decode
from streamer import demo, models, weights
from streamer.bus import FIELD, entry, entry_event
from streamer.config import RunConfig, replace


def _cfg(keys, redis_url, tmp_path) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path / "data")},
        producer={"group_size": 2, "max_new_tokens": 2, "torch_threads": 1},
        trainer={"groups_per_step": 1000},
        eval={"max_rows": 4, "max_new_tokens": 2, "eval_every": 1},
    )


def _bad_syncs(cfg: RunConfig, tmp_path) -> list[tuple[str, str, str]]:
    """(case, uri, sha256): each must be refused."""
    root = cfg.weights_dir
    outside = tmp_path / "elsewhere"
    uri_out, sha_out = weights.write_version(demo.build_model(seed=5), outside, 1)  # valid, right sha
    uri_in, _ = weights.write_version(demo.build_model(seed=6), root, 2)
    (root / "link").symlink_to(weights.version_dir(outside, 1), target_is_directory=True)
    rel = os.path.relpath(weights.version_dir(outside, 1), root)
    return [
        ("outside the directory", uri_out, sha_out),
        ("dot-dot", f"{root.resolve().as_uri()}/{rel}", sha_out),
        ("percent-encoded dot-dot", f"{root.resolve().as_uri()}/{rel.replace('..', '%2e%2e')}", sha_out),
        ("symlink out", (root / "link").absolute().as_uri(), sha_out),
        ("relative path", f"file:{rel}", sha_out),
        ("other scheme", f"http://127.0.0.1:1/{rel}", sha_out),
        ("missing directory", f"{root.resolve().as_uri()}/v99999999", sha_out),
        ("wrong sha256", uri_in, "0" * 64),
    ]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_producer_and_evaluator_refuse_weights_outside_the_directory_or_with_a_wrong_sha(
    client, keys, redis_url, tmp_path, caplog
):
    cfg = _cfg(keys, redis_url, tmp_path)
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
    tok = models.load_tokenizer(cfg.model)
    ev_sampler, stops = local_sampler(cfg, tok)
    ev_task = load_task(cfg, dataset="demo", split="eval", tokenizer=tok, extra_stop_ids=stops)
    evaluator = Evaluator(cfg, client=client, task=ev_task, sampler=ev_sampler)
    evaluator.start()  # evaluates the initial weights (version 0)
    cases = _bad_syncs(cfg, tmp_path)
    before = {"producer": _params(sampler.model), "eval": _params(ev_sampler.model)}
    refused = {"producer": 0, "eval": 0}
    # each bad version is followed by a good one, so no streak of failures ends the process
    good, bad_versions = 100, []
    with caplog.at_level(logging.ERROR, logger="producers.follow"):
        for case, uri, sha in cases:
            version = good + 1
            bad_versions.append(version)
            good += 2
            client.xadd(keys.policy, entry(WeightSync(version=version, step=version, uri=uri, sha256=sha)))
            assert producer.step() == "published", case
            group = decode(client.xrange(keys.traj)[-1][1][FIELD], TrajectoryGroup)
            refused["producer"] += group.policy_version == producer.follower.version and _same(
                before["producer"], _params(sampler.model)
            )
            refused["eval"] += evaluator.step() is None and _same(before["eval"], _params(ev_sampler.model))
            model = demo.build_model(seed=good)
            ok_uri, ok_sha = weights.write_version(model, cfg.weights_dir, good)
            client.xadd(keys.policy, entry(WeightSync(version=good, step=good, uri=ok_uri, sha256=ok_sha)))
            assert producer.step() == "published" and producer.follower.version == good, case
            assert evaluator.step() == good, case
            before = {"producer": _params(sampler.model), "eval": _params(ev_sampler.model)}
        logged = sum(f"cannot load policy version {v} " in caplog.text for v in bad_versions)
    rollout = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    counted = sum(e.values.get("weight_load_errors", 0) for e in rollout if e.axis == "rollout")

    good += 1
    uri, sha = weights.write_version(demo.build_model(seed=7), cfg.weights_dir, good)
    client.xadd(keys.policy, entry(WeightSync(version=good, step=good, uri=uri, sha256=sha)))
    assert producer.step() == "published"
    assert evaluator.step() == good
    loaded_after = decode(client.xrange(keys.traj)[-1][1][FIELD], TrajectoryGroup).policy_version == good
    producer.close()
    report(
        "weight-sync-refused",
        cases=len(cases),
        producer_refused=refused["producer"],
        evaluator_refused=refused["eval"],
        producer_errors_counted=int(counted),
        evaluator_errors_counted=evaluator.follower.errors,
        log_lines=logged,
        loaded=0 if refused["producer"] == len(cases) else "?",
        good_version_loaded_after=loaded_after,
    )
    assert refused == {"producer": len(cases), "eval": len(cases)}, refused
    assert counted == len(cases) and producer.follower.errors == len(cases)
    assert evaluator.follower.errors == len(cases)
    assert logged == len(cases), caplog.text
    assert loaded_after and evaluator.evaluated == [0, *range(102, good, 2), good]


def test_a_producer_that_cannot_load_three_versions_in_a_row_stops_and_status_names_it(
    client, keys, redis_url, tmp_path, monkeypatch
):
    """A weights file tampered with after the manifest was written (NaN bytes, same size: the
    manifest's sha256 and sizes still match) is refused before it is loaded into the model;
    the producer does not go on sampling version 0 for ever, nor charge the failures to the
    rows."""
    from producers import follow
    from streamer.cli.status import render
    from streamer.readmodel import snapshot

    monkeypatch.setattr(follow, "RETRY_SECONDS", 0.01)
    cfg = _cfg(keys, redis_url, tmp_path)
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
    before = _params(sampler.model)
    uri, sha = weights.write_version(demo.build_model(seed=5), cfg.weights_dir, 1)
    f = weights.version_dir(cfg.weights_dir, 1) / weights.WEIGHTS_FILE
    head_len = 8 + int.from_bytes(f.read_bytes()[:8], "little")
    data = bytearray(f.read_bytes())
    data[head_len:] = bytes.fromhex("0000c07f") * ((len(data) - head_len) // 4)  # float32 NaN
    f.write_bytes(bytes(data))
    client.xadd(keys.policy, entry(WeightSync(version=1, step=1, uri=uri, sha256=sha)))
    with pytest.raises(weights.WeightsError) as err:
        for _ in range(20):
            producer.step()
    producer.close()
    message = str(err.value)
    assert "cannot load policy version 1" in message and str(f) in message and "mismatch" in message, message
    assert f"gave up after {follow.MAX_LOAD_FAILURES} failed loads" in message
    assert _same(before, _params(sampler.model))  # nothing of the bad file was copied in
    assert not client.hlen(keys.row_attempts), "a version that does not load is not the rows' fault"
    snap = snapshot(client, keys)
    assert snap.stalled and any(
        "producer p" in r and "cannot load policy version 1" in r for r in snap.reasons
    )
    assert "problems" in render(snap)
