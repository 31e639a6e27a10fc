"""Producers against a real server: groups and metrics as published, weight following,
failed rewards, admission under concurrency, and whole processes: three producers cover
each epoch exactly once, a SIGKILLed producer's row is handed out again, SIGTERM exits 0
and hands its row back, a bad dataset line is named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from bounds import RUN, START
from waits import Watch, wait_until

from producers.components import Task, build
from producers.dataset import Order
from producers.fake_server import FakeCompletionsServer, canned
from producers.producer import Producer
from schemas import MetricsEvent, TrajectoryGroup, WeightSync, decode, encode
from schemas.metric_names import ROLLOUT
from streamer import demo, weights
from streamer.admission import Admission
from streamer.config import RunConfig, replace, write_toml
from streamer.connection import connect

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(cond, timeout: float, what: str, procs: dict | None = None, tmp_path: Path | None = None):
    """Until ``cond``; fail on timeout, or at once when one of ``procs`` (id -> Popen, logging
    to ``tmp_path/<id>.log``) exited, with its exit code and log tail."""
    watch = Watch(*procs.values(), log=[tmp_path / f"{pid}.log" for pid in procs]) if procs else None
    return wait_until(cond, timeout=timeout, what=what, watch=watch)


def _cfg(keys, redis_url, tmp_path, **sections) -> RunConfig:
    base = {"group_size": 4, "max_new_tokens": 3, "torch_threads": 1}
    sections["producer"] = {**base, **sections.get("producer", {})}
    sections.setdefault("trainer", {"groups_per_step": 1000})
    return replace(
        RunConfig(), run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)}, **sections
    )


def _groups(client, keys) -> list[TrajectoryGroup]:
    return [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]


def _metrics(client, keys) -> list[MetricsEvent]:
    return [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]


def _producer(cfg, client, pid="p1", reward_fn=None, stop=None) -> Producer:
    task, sampler = build(cfg)
    if reward_fn is not None:
        task = Task(rows=task.rows, renderer=task.renderer, reward_fn=reward_fn, reward_path="test")
    return Producer(cfg, client=client, producer_id=pid, task=task, sampler=sampler, stop=stop)


# ---------------------------------------------------------------- in-process


def test_groups_and_metrics_as_published(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path, producer={"max_groups": 2})
    assert _producer(cfg, client).run() == 0
    groups = _groups(client, keys)
    assert len(groups) == 2 and len({g.group_id for g in groups}) == 2
    rows = demo.rows()
    for g in groups:
        assert g.group_id == f"{g.epoch}:{g.row}" and g.producer_id == "p1" and g.policy_version == 0
        assert len(g.samples) == 4 and all(s.version == 0 for s in g.samples)
        for s in g.samples:  # the prompt is the rendered row; rewards are the demo's
            prompt = demo.tokenizer().decode(s.token_ids()[: s.prompt_len].tolist())
            assert prompt.endswith("=<|end|><|assistant|>")
            text = demo.tokenizer().decode(s.completion_ids().tolist(), skip_special_tokens=True)
            assert s.reward == demo.reward(rows[g.row], text)
    events = _metrics(client, keys)
    assert [e.step for e in events] == [1, 2] and {e.axis for e in events} == {"rollout"}
    assert all(set(e.values) <= set(ROLLOUT) and e.source == "producer-p1" for e in events)
    assert events[0].values["groups"] == 1 and events[0].values["samples"] == 4
    assert events[0].values["reward_mean"] == pytest.approx(groups[0].rewards().mean())
    assert client.zcard(keys.leases) == 0 and client.zscore(keys.producers, "p1") is None


def test_a_new_weightsync_changes_the_version_of_the_next_groups(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path)
    p = _producer(cfg, client)
    assert p.step() == "published" and _groups(client, keys)[-1].policy_version == 0
    uri, sha = weights.write_version(demo.build_model(seed=5), cfg.weights_dir, 1)
    client.xadd(keys.policy, {b"d": encode(WeightSync(version=1, step=1, uri=uri, sha256=sha))})
    assert p.step() == "published"
    g = _groups(client, keys)[-1]
    assert g.policy_version == 1 and {s.version for s in g.samples} == {1}
    assert _metrics(client, keys)[-1].values["weight_loads"] == 1
    uri2, _ = weights.write_version(demo.build_model(seed=6), cfg.weights_dir, 2)
    client.xadd(keys.policy, {b"d": encode(WeightSync(version=2, step=2, uri=uri2, sha256="0" * 64))})
    assert p.step() == "published"  # a version that cannot be loaded: keep sampling with v1
    assert _groups(client, keys)[-1].policy_version == 1
    assert _metrics(client, keys)[-1].values["weight_load_errors"] == 1
    p.close()


def test_failed_rewards_drop_samples_and_too_small_groups(client, keys, redis_url, tmp_path):
    calls = iter(range(1000))

    def every_other_fails(row, text, sample):
        if next(calls) % 2:
            raise RuntimeError("grader crashed")
        return 1.0

    cfg = _cfg(keys, redis_url, tmp_path, producer={"min_group_size": 2})
    assert _producer(cfg, client, reward_fn=every_other_fails).step() == "published"
    (g,) = _groups(client, keys)
    assert len(g.samples) == 2 and _metrics(client, keys)[-1].values["sample_failures"] == 2

    def always_fails(row, text, sample):
        raise ValueError("no")

    assert _producer(cfg, client, reward_fn=always_fails).step() == "dropped"
    assert len(_groups(client, keys)) == 1  # nothing published
    last = _metrics(client, keys)[-1].values
    assert last["groups_dropped"] == 1 and last["sample_failures"] == 4 and "groups" not in last
    assert Admission(client, keys, max_staleness=0, groups_per_step=1).snapshot()["admitted"] == 1


def test_admission_counter_is_exact_under_concurrency(redis_url, keys):
    granted = []

    def hammer():
        c = connect(redis_url)
        adm = Admission(c, keys, max_staleness=1, groups_per_step=5)
        granted.extend(ok for _ in range(50) if (ok := adm.try_admit()))
        c.close()

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    c = connect(redis_url)
    assert len(granted) == 10 and int(c.get(keys.admitted)) == 10  # (1 + 0 + 1) * 5
    c.close()


def test_rows_waiting_for_admission_go_on_together_once_one_finds_the_window_open():
    """Three rows wait for a slot. The first to ask after the window opens (on its own short
    back-off) wakes the others, whose next ask was 60 s away: all three are in at once."""
    import anyio

    from producers.inflight import AdmissionWaits

    window, asks, admitted = [0], [], []

    async def row(name: str, poll: float, waits: AdmissionWaits) -> None:
        async def try_admit() -> bool:
            asks.append(name)
            if window[0] > 0:
                window[0] -= 1
                return True
            return False

        await waits.wait(try_admit, lambda: False, poll=poll)
        admitted.append(name)

    async def main() -> None:
        waits = AdmissionWaits()
        with anyio.fail_after(30):  # the slow rows' own next ask: 60 s
            async with anyio.create_task_group() as tg:
                for name, poll in (("slow-1", 60.0), ("slow-2", 60.0), ("fast", 1.0)):
                    tg.start_soon(row, name, poll, waits)
                await anyio.wait_all_tasks_blocked()
                assert sorted(asks) == ["fast", "slow-1", "slow-2"] and not admitted, "all wait"
                window[0] = 3  # a trainer step released three slots

    anyio.run(main)
    assert admitted[0] == "fast" and sorted(admitted[1:]) == ["slow-1", "slow-2"]
    assert len(asks) == 6, f"one more ask each once the window opened: {asks}"


def test_concurrent_producers_never_exceed_the_admission_rule(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path, trainer={"groups_per_step": 2, "max_staleness": 0})
    stop = threading.Event()
    producers = [_producer(cfg, connect(redis_url), pid=f"p{i}", stop=stop) for i in range(3)]
    threads = [threading.Thread(target=p.run) for p in producers]
    for t in threads:
        t.start()
    try:
        admission = Admission(client, keys, max_staleness=0, groups_per_step=2)
        for step, allowed in ((0, 2), (1, 4)):
            if step:  # the trainer trained the two groups out: their slots come back, once
                trained = [e for e, _ in client.xrange(keys.traj)]
                assert admission.release(trained) == 2 and admission.release(trained) == 0
            # every producer holds a row and waits for a slot: nothing more can be published
            _wait_for(lambda n=allowed: _blocked(client, keys, n), 30, f"3 producers blocked at step {step}")
            assert client.xlen(keys.traj) == allowed and int(client.get(keys.admitted)) == 2
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert all(not t.is_alive() for t in threads)
    assert client.llen(keys.requeue) == 3 and client.zcard(keys.leases) == 0  # rows handed back
    assert int(client.get(keys.admitted)) == 2 and client.zcard(keys.producers) == 0


def _blocked(client, keys, published: int) -> bool:
    """``published`` groups out, and each of the 3 producers holds a row but no slot."""
    return (
        client.xlen(keys.traj) >= published
        and client.hlen(keys.lease_owner) == 3
        and client.scard(keys.lease_slots) == 0
    )


# ---------------------------------------------------------------- processes


def _write_config(tmp_path, keys, redis_url, **producer) -> Path:
    path = tmp_path / f"run-{len(list(tmp_path.glob('run-*.toml')))}.toml"
    return write_toml(
        path,
        {
            "run": {"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
            "trainer": {"groups_per_step": 1000},
            "bus": {"max_unacked": 1000},
            "producer": {"group_size": 2, "max_new_tokens": 2, "torch_threads": 1, **producer},
        },
    )


def _spawn(config: Path, pid: str, tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / f"{pid}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "streamer", "produce", "--config", str(config), "--id", pid],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )


def _exit(proc: subprocess.Popen, tmp_path: Path, pid: str, timeout: float = RUN) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log = (tmp_path / f"{pid}.log").read_text()[-3000:]
        raise AssertionError(f"{pid} did not exit:\n{log}") from None


def _dataset(tmp_path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"prompt": "{i % 10}+1=", "answer": "{(i + 1) % 10}"}}\n' for i in range(n)))
    return path


@pytest.mark.slow
def test_three_processes_cover_each_epoch_exactly_once(client, keys, redis_url, tmp_path):
    config = _write_config(tmp_path, keys, redis_url, dataset=str(_dataset(tmp_path, 6)), epochs=2)
    gate = Admission(client, keys, max_staleness=0, groups_per_step=1)
    gate.publish_limits(max_staleness=0, groups_per_step=0)
    procs = {pid: _spawn(config, pid, tmp_path) for pid in ("a", "b", "c")}
    # admission is shut: each claims a row and waits, so all three take part (and each
    # heartbeat thread has written its first beat)
    _wait_for(
        lambda: (
            set(client.hvals(keys.lease_owner)) == {b"a", b"b", b"c"} and client.zcard(keys.producers) == 3
        ),
        START,
        "3 producers with a row and a heartbeat",
        procs,
        tmp_path,
    )
    gate.publish_limits(max_staleness=0, groups_per_step=100)
    assert [_exit(p, tmp_path, pid) for pid, p in procs.items()] == [0, 0, 0]
    groups = _groups(client, keys)
    assert sorted((g.epoch, g.row) for g in groups) == [(e, r) for e in range(2) for r in range(6)]
    assert {g.producer_id for g in groups} == {"a", "b", "c"}
    assert client.zcard(keys.leases) == 0 and client.zcard(keys.producers) == 0
    assert int(client.get(keys.admitted)) == 12


@pytest.mark.slow
def test_a_sigkilled_producers_row_is_handed_out_again(client, keys, redis_url, tmp_path):
    with FakeCompletionsServer(canned([10, 5])) as server:  # answers "4" then EOS
        server.pass_first = 1  # the producer's readiness probe
        server.hold.clear()  # requests wait: the first producer dies mid-row
        config = _write_config(
            tmp_path,
            keys,
            redis_url,
            dataset=str(_dataset(tmp_path, 4)),
            epochs=1,
            sampler="remote",
            remote_url=server.url,
            lease_seconds=1.0,
        )
        victim = _spawn(config, "victim", tmp_path)
        assert server.started.wait(START), (tmp_path / "victim.log").read_text()
        (ticket,) = [int(t) for t, owner in client.hgetall(keys.lease_owner).items() if owner == b"victim"]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        server.hold.set()
        heir = _spawn(config, "heir", tmp_path)
        assert _exit(heir, tmp_path, "heir") == 0
    groups = _groups(client, keys)
    assert sorted(g.row for g in groups) == [0, 1, 2, 3] and {g.producer_id for g in groups} == {"heir"}
    assert Order(4, seed=0).position(ticket).row in [g.row for g in groups]  # the victim's row
    assert int(client.get(keys.admitted)) == 4  # the dead producer's slot came back
    assert client.zcard(keys.leases) == 0


@pytest.mark.slow
def test_sigterm_hands_the_row_back_within_the_grace_period(client, keys, redis_url, tmp_path):
    with FakeCompletionsServer(canned([10, 5])) as server:
        server.pass_first = 1  # the producer's readiness probe
        server.hold.clear()  # sampling never finishes: the grace period decides
        config = _write_config(
            tmp_path, keys, redis_url, sampler="remote", remote_url=server.url, shutdown_grace=1.0
        )
        proc = _spawn(config, "p", tmp_path)
        assert server.started.wait(START), (tmp_path / "p.log").read_text()
        assert client.zscore(keys.producers, "p") is not None
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert _exit(proc, tmp_path, "p", timeout=20) == 0
        assert time.monotonic() - start < 10
        server.hold.set()
    assert client.lrange(keys.requeue, 0, -1) == [b"0"] and client.zcard(keys.leases) == 0
    assert client.zscore(keys.producers, "p") is None and client.xlen(keys.traj) == 0
    assert int(client.get(keys.admitted) or 0) == 0


@pytest.mark.slow
def test_a_bad_dataset_line_is_named(keys, redis_url, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3}\n')
    config = _write_config(tmp_path, keys, redis_url, dataset=str(bad))
    out = subprocess.run(
        [sys.executable, "-m", "streamer", "produce", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=START,
    )
    assert out.returncode == 2, out.stderr
    assert f"{bad}:2: `prompt` must be a non-empty string" in out.stderr
