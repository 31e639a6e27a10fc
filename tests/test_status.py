"""`streamer status` on a synthetic run: the table, --json, stalled -> exit 1, no password."""

from __future__ import annotations

import json
import re
import time

import pytest

from schemas import DeadLetter, WeightSync
from streamer import cli
from streamer.bus import FIELD, Publisher
from streamer.config import RunConfig
from streamer.connection import connect
from streamer.errors import DataError
from streamer.keys import Keys
from streamer.readmodel.health import snapshot
from streamer.server import EmbeddedServer


def seed_run(client, keys: Keys, *, policy_age: float = 2.0, waiting: bool = True) -> float:
    """Five versions 2 s apart (0.5 steps/s), a trainer group, producers, dead letters."""
    now = time.time()
    pub = Publisher(client, keys, RunConfig().bus)
    for v in range(1, 6):
        at = now - policy_age - (5 - v) * 2.0
        pub.publish(keys.policy, WeightSync(version=v, step=v, uri=f"file:///w/{v}", sha256="0" * 64, at=at))
    client.xgroup_create(keys.traj, "trainer", id="0", mkstream=True)
    for i in range(4 if waiting else 0):
        client.xadd(keys.traj, {FIELD: b"group %d" % i})
    client.xreadgroup("trainer", "t", {keys.traj: ">"}, count=1)  # 1 pending, 3 lag
    client.zadd(keys.producers, {"host-1": now - 1.0, "host-2": now - 120.0})
    for i, reason in enumerate(["malformed msgpack", "delivered 6 times (max 5)", "invalid TrajectoryGroup"]):
        pub.publish(keys.dead, DeadLetter(stream=keys.traj, entry_id=f"{i}-1", raw=b"", reason=reason))
    client.set(keys.admitted, 3)
    client.set(keys.version, 5)  # the trainer mirrors the policy version here for admission
    client.hset(keys.limits, mapping={"max_staleness": 1, "groups_per_step": 2})
    client.hset(keys.skipped_rows, "7", "3 attempts failed; last: rollout raised ValueError: no such key")
    return now


def status(capsys, url: str, run: str, *extra: str) -> tuple[int, str]:
    rc = cli.main(["status", "--redis-url", url, "--run", run, *extra])
    return rc, capsys.readouterr().out


def test_json_for_scripts(client, keys, redis_url, capsys):
    seed_run(client, keys)
    rc, out = status(capsys, redis_url, keys.run, "--json")
    assert rc == 0, out
    s = json.loads(out)
    assert s["run"] == keys.run and not s["stalled"] and s["reasons"] == []
    assert (s["policy"]["version"], s["policy"]["step"]) == (5, 5)
    assert 1.5 < s["policy"]["age_seconds"] < 30
    assert s["step_rate"] == pytest.approx(0.5, rel=1e-3)
    assert (s["live_producers"], s["known_producers"]) == (1, 2)
    assert [(p["id"], p["live"]) for p in s["producers"]] == [("host-1", True), ("host-2", False)]
    assert s["dead_letters"] == 3
    assert [d["reason"] for d in s["dead_last"]] == [
        "invalid TrajectoryGroup",
        "delivered 6 times (max 5)",
        "malformed msgpack",
    ]
    traj = next(x for x in s["streams"] if x["name"] == "traj")
    assert traj["length"] == 4
    assert [(g["name"], g["lag"], g["pending"]) for g in traj["groups"]] == [("trainer", 3, 1)]
    assert s["waiting_groups"] == 4 and s["admitted"] == 3
    assert s["skipped_rows"] == 1 and s["skipped_last"] == {"7": client.hget(keys.skipped_rows, "7").decode()}
    assert [x["name"] for x in s["streams"]] == ["traj", "policy", "metrics", "dead"]


def test_table_for_people(client, keys, redis_url, capsys):
    seed_run(client, keys)
    rc, out = status(capsys, redis_url, keys.run)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0] == f"run {keys.run} on {redis_url}"
    assert "version 5 (step 5)" in out and "0.5 steps/s" in out
    assert "3 of 4 slots held; 4 groups wait" in out  # (1 + 1) * 2 in flight
    (traj,) = [ln.split() for ln in lines if ln.strip().startswith("traj ")]
    assert traj == ["traj", "4", "4", "trainer", "3", "1", "1"]
    # seeded 120 s before the call; the seconds digit tolerates a slow machine between the two
    assert any(re.fullmatch(r"host-2 +2m0\ds .*gone", ln.strip()) for ln in lines), out
    assert "dead letters 3" in out and "malformed msgpack" in out
    assert "skipped rows 1 (each failed producer.max_row_attempts times)" in out
    assert any(
        re.fullmatch(r"7 +3 attempts failed; last: rollout raised ValueError: no such key", ln.strip())
        for ln in lines
    )
    assert lines[-1] == "status      ok"


def test_stalled_exits_1(client, keys, redis_url, capsys, tmp_path):
    seed_run(client, keys, policy_age=20.0)
    assert status(capsys, redis_url, keys.run)[0] == 0  # 20 s < the default 300 s
    cfg = tmp_path / "run.toml"
    cfg.write_text("[metrics]\nstall_seconds = 10\n")
    rc, out = status(capsys, redis_url, keys.run, "--config", str(cfg))
    assert rc == 1
    assert out.splitlines()[-1].startswith("STALLED: no new policy version for 2")
    assert "4 trajectory groups wait" in out
    rc, out = status(capsys, redis_url, keys.run, "--config", str(cfg), "--json")
    assert rc == 1 and json.loads(out)["stalled"] is True


def test_idle_run_is_not_stalled_and_a_run_without_versions_is(client, keys):
    seed_run(client, keys, policy_age=1000.0, waiting=False)
    assert snapshot(client, keys, stall_seconds=10).stalled is False  # nothing waits
    fresh = Keys(keys.run + "-b")
    try:
        old = int((time.time() - 60) * 1000)
        client.xadd(fresh.traj, {FIELD: b"x"}, id=f"{old}-0")
        snap = snapshot(client, fresh, stall_seconds=10)
        assert snap.stalled and "a first policy version" in snap.reasons[0]
        assert snapshot(client, fresh, stall_seconds=100).stalled is False
    finally:
        client.delete(fresh.traj)


@pytest.mark.parametrize("name", ["limits", "policy", "producers", "version"])
def test_a_key_of_the_wrong_type_is_named_with_the_type_it_should_hold(client, keys, redis_url, capsys, name):
    key = getattr(keys, name)
    want = keys.types()[key]
    if want == "string":
        client.rpush(key, "a", "list")
    else:
        client.set(key, "a string")
    got = "list" if want == "string" else "string"
    line = f"{key} is a {got}, where this run keeps a {want}; fix or delete the key (`DEL {key}`)"
    with pytest.raises(DataError) as e:
        snapshot(client, keys)  # as the exporter reads it
    assert str(e.value) == line
    assert cli.main(["status", "--redis-url", redis_url, "--run", keys.run]) == 1
    assert capsys.readouterr().err == f"streamer status: {line}\n"


@pytest.mark.slow
def test_empty_run_and_password_is_never_printed(tmp_path, capsys):
    server = EmbeddedServer(tmp_path / "valkey", password="s3cret-pw").start()
    try:
        rc, out = status(capsys, server.url, "nothing-here")
        assert rc == 0 and "no version published yet" in out
        assert "s3cret-pw" not in out and ":***@" in out
        rc, out = status(capsys, server.url, "nothing-here", "--json")
        assert rc == 0 and "s3cret-pw" not in out
        assert json.loads(out)["policy"] is None
        bad = server.url.replace("s3cret-pw", "wrong-pw")
        assert cli.main(["status", "--redis-url", bad, "--run", "x"]) == 1
        captured = capsys.readouterr()
        assert "wrong-pw" not in captured.out + captured.err
    finally:
        server.stop()


def test_connect_helper_redacts(redis_url):
    client = connect(redis_url)
    try:
        assert snapshot(client, Keys("never-used")).streams[0].length == 0
    finally:
        client.close()
