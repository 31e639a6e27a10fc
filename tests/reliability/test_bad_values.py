"""Values an operator or a bug leaves in the server: each role that reads one exits with one
line naming the key, never a traceback; the archiver and `up`'s summary, which only report,
carry on and say what they could not read."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
from harness import report, run_config_in
from trainer_data import REPO, make_group, publish

from consumers.archive import Archiver
from streamer import demo
from streamer.cli.progress import Progress
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "key, value, role",
    [
        ("version", "not-a-number", "train"),
        ("limits", "a string, not a hash", "status"),
        ("admitted", "many", "produce"),
        ("rollout_step", "many", "produce"),
        ("traj", "a string, not a stream", "train"),
        ("admitted", ["a", "list"], "train"),
        ("metrics", "a string, not a stream", "produce"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(private_valkey, procs, tmp_path, key, value, role):
    url, keys = private_valkey.url, Keys("bad")
    client = connect(url)
    if isinstance(value, list):
        client.rpush(getattr(keys, key), *value)
    else:
        client.set(getattr(keys, key), value)
    config = run_config_in(tmp_path, keys, producer={"max_groups": 1})
    procs.start(role, role, "--config", str(config), "--redis-url", url)
    code = procs.wait(role, 180)
    log = procs.log(role)
    report("bad-value", key=key, role=role, exit=code)
    assert code == 1, log
    assert "Traceback" not in log and getattr(keys, key) in log, log[-3000:]


def _cfg(keys, url, tmp_path) -> RunConfig:
    return replace(RunConfig(), run={"name": keys.run, "redis_url": url, "data_dir": str(tmp_path / "data")})


def test_the_archiver_and_the_summary_carry_on_past_a_bad_version_key(
    client, keys, redis_url, tmp_path, caplog
):
    client.set(keys.version, "v-seven")
    publish(client, keys.traj, [make_group(random.Random(i)) for i in range(3)])
    cfg = _cfg(keys, redis_url, tmp_path)
    archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
    with caplog.at_level(logging.WARNING):
        while archiver.step(block=0.1):
            pass
        summary = Progress(cfg, target_steps=1, live=False).summary(1.0, tmp_path)
    archiver.close()
    assert archiver.archived == 3
    assert "policy version     ?" in summary
    named = [r.getMessage() for r in caplog.records if keys.version in r.getMessage()]
    assert named and all("'v-seven'" in m for m in named), caplog.text


def test_up_needs_at_least_one_producer(tmp_path):
    for n in ("0", "-1"):
        res = subprocess.run(
            [sys.executable, "-m", "streamer", "up", "--producers", n, "--redis-url", "redis://127.0.0.1:1/0"]
            + ["--data-dir", str(tmp_path), "--no-progress"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2, res.stderr
        assert "argument --producers" in res.stderr and "at least 1" in res.stderr, res.stderr
