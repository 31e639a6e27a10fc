"""Rows that can never succeed: refused up front when they lack what the reward
reads; skipped with a counted reason after ``producer.max_row_attempts`` failed attempts,
instead of being handed out first, forever."""

from __future__ import annotations

import json

import pytest
from harness import NoisyBackend, report, run_config_in

from producers.fake_server import BadRequest, FakeCompletionsServer
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


def _dataset(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_without_the_rewards_field_are_refused_before_any_work(procs, redis_url, tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2="}, {"prompt": "3+3="}]
    data = _dataset(tmp_path / "rows.jsonl", rows)
    keys = Keys("norew")
    config = run_config_in(tmp_path, keys, producer={"dataset": str(data)})
    procs.start("producer", "produce", "--config", str(config), "--redis-url", redis_url)
    assert procs.wait("producer", 120) == 2, procs.tails()
    log = procs.log("producer")
    assert "row 1 (and 1 more) has no `answer`, which the reward streamer.demo:reward needs" in log, log
    assert connect(redis_url).xlen(keys.traj) == 0


def test_a_row_that_always_fails_is_skipped_with_its_reason(private_valkey, procs, tmp_path):
    noisy = NoisyBackend(seed=1, right=0.5)

    def backend(body):
        if "9+9" in noisy.tok.decode(body["prompt"]):
            raise BadRequest("prompt too long for the engine")  # the row that always fails: HTTP 400
        return noisy(body)

    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)] + [
        {"prompt": "9+9=", "answer": "8"}
    ]
    data = _dataset(tmp_path / "rows.jsonl", rows)
    url, keys = private_valkey.url, Keys("skip")
    with FakeCompletionsServer(backend) as server:
        config = run_config_in(
            tmp_path,
            keys,
            sampler_url=server.url,
            producer={"dataset": str(data), "remote_retries": 0, "epochs": 1, "max_row_attempts": 2},
        )
        procs.start("producer", "produce", "--config", str(config), "--redis-url", url, "--id", "p0")
        code = procs.wait("producer", 180)
    client = connect(url)
    skipped = {int(t): r.decode() for t, r in client.hgetall(keys.skipped_rows).items()}
    report("row-skipped", exit=code, published=client.xlen(keys.traj), skipped=len(skipped))
    assert code == 0, procs.tails()
    assert client.xlen(keys.traj) == 4 and len(skipped) == 1, (skipped, procs.tails())
    (reason,) = skipped.values()
    assert reason.startswith("2 attempts failed; last: sampler:"), reason
    assert client.hlen(keys.row_attempts) == 0 and client.llen(keys.requeue) == 0
