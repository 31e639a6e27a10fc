"""Values an operator or a bug leaves in the server: each role that reads one exits with one
line naming the key, never a traceback; the archiver and `up`'s summary, which only report,
carry on and say what they could not read. A key given another type while the trainer runs
is named the same way, from whichever of its threads meets it."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import redis
from harness import report, run_config_in
from trainer_data import REPO, make_group, publish
from waits import wait_until

from consumers.archive import Archiver
from streamer import demo
from streamer.bus import as_str
from streamer.cli.progress import Progress
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import TRAINER_GROUP, Keys

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


def _spoil(client, key: str, kind: str) -> str:
    """Give ``key`` another type than ``kind``, in one step (a command blocked on it sees the
    new type, not a missing key); returns the type it has now."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    if kind == "string":
        pipe.rpush(key, "a", "list")
    else:
        pipe.set(key, "a string")
    pipe.execute()
    return "list" if kind == "string" else "string"


# the keys a trainer step meets (a read, a rejection, the release of the step's slots, the
# version's announcement under the fencing token, the checkpoint's record and data position)
MID_RUN = ["traj", "rejected_since_step", "held_slots", "version", "trainer_fence", "run_marker", "cursor"]


def _running_trainer(server, procs, tmp_path) -> tuple:
    """A `streamer train` past its start (its check of every key's type), waiting for groups."""
    client, keys = connect(server.url), Keys("mid")
    config = run_config_in(tmp_path, keys, trainer={"checkpoint_every": 1})  # 2 groups a step
    procs.start("train", "train", "--config", str(config), "--redis-url", server.url)
    wait_until(
        lambda: client.exists(keys.policy) and client.xlen(keys.policy) >= 1,
        timeout=180,
        what="the trainer to announce its first version",
        watch=procs,
    )
    # and its feed to hold its group on the trajectory stream (it creates the stream if missing)
    wait_until(
        lambda: any(as_str(g["name"]) == TRAINER_GROUP for g in client.xinfo_groups(keys.traj)),
        timeout=60,
        what="the trainer's group on the trajectory stream",
        watch=procs,
        ignore=(redis.exceptions.ResponseError,),
    )
    return client, keys


@pytest.mark.parametrize("name", MID_RUN)
def test_a_key_given_another_type_under_a_running_trainer_is_one_line(private_valkey, procs, tmp_path, name):
    client, keys = _running_trainer(private_valkey, procs, tmp_path)
    key = getattr(keys, name)
    want = keys.types()[key]
    got = _spoil(client, key, want)
    if name != "traj":
        rewards = (1.0, 1.0, 1.0, 1.0) if name == "rejected_since_step" else (1.0, 0.0, 0.0, 1.0)
        publish(client, keys.traj, [make_group(random.Random(i), rewards=rewards) for i in range(2)])
    code = procs.wait("train", 180)
    log = procs.log("train")
    report("wrong-type-mid-run", key=name, exit=code, tracebacks=log.count("Traceback"))
    assert code == 1 and "Traceback" not in log, log[-4000:]
    assert f"{key} is a {got}, where this run keeps a {want}" in log, log[-3000:]


def test_the_trajectory_stream_deleted_under_a_running_trainer_is_one_line(private_valkey, procs, tmp_path):
    client, keys = _running_trainer(private_valkey, procs, tmp_path)
    client.delete(keys.traj)  # the trainer's read: NOGROUP, its group went with the stream
    code = procs.wait("train", 180)
    log = procs.log("train")
    report("traj-deleted-mid-run", exit=code, tracebacks=log.count("Traceback"))
    assert code == 1 and "Traceback" not in log, log[-4000:]
    assert (
        f"streamer train: the server refused a command on this run's keys: NOGROUP No such key '{keys.traj}'"
        in log
    )


@pytest.mark.parametrize("name", ["metrics_snapshot", "problems"])
def test_up_names_a_key_of_the_wrong_type_before_it_starts_anything(private_valkey, tmp_path, name):
    url, keys = private_valkey.url, Keys("demo")
    key = getattr(keys, name)
    got = _spoil(connect(url), key, keys.types()[key])
    data = tmp_path / "data"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamer",
            "up",
            "--redis-url",
            url,
            "--data-dir",
            str(data),
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = res.stdout + res.stderr
    started = sorted(p.stem for p in data.rglob("*.log"))  # a role's log: it was started
    report("wrong-type-at-up-start", key=name, exit=res.returncode, roles_started=len(started))
    assert res.returncode == 1 and "Traceback" not in out and not started, (started, out[-3000:])
    assert f"streamer up: {key} is a {got}, where this run keeps a {keys.types()[key]}" in res.stderr, out
