"""The metrics exporter against a real server: events in, exact series out; restarts."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from bounds import START
from prometheus_client.parser import text_string_to_metric_families
from waits import Watch, wait_until

from consumers.exporter import SERIES, Exporter
from schemas import DeadLetter, MetricsEvent, WeightSync
from schemas.metric_names import REJECT_REASONS, TOKENS_BEHIND
from streamer.bus import FIELD, Publisher, entry
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import METRICS_GROUP, Keys
from streamer.server import free_port

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(redis_url: str, run: str, **metrics) -> RunConfig:
    return replace(
        RunConfig(),
        run={"redis_url": redis_url, "name": run},
        metrics={"port": 0, "health_interval": 0.2, **metrics},
        bus={"block_seconds": 0.2, "socket_timeout": 5.0},
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def axis_series(samples: dict) -> dict:
    """Only the event-derived series (train/rollout/eval axes)."""
    axes = ("streamer_train_", "streamer_rollout_", "streamer_eval_")
    health = "streamer_train_seconds_since_last_step"
    return {k: v for k, v in samples.items() if k[0].startswith(axes) and k[0] != health}


def drain(ex: Exporter, expect_events: int) -> None:
    """Consume until the exporter has applied ``expect_events`` in all (bounded)."""
    deadline = time.monotonic() + 30
    while sum(ex.state.events.values()) < expect_events:
        assert time.monotonic() < deadline, f"applied {ex.state.events}, expected {expect_events} events"
        ex.consume(block=0.1)


def ev(axis: str, step: int, source: str, **values: float) -> MetricsEvent:
    return MetricsEvent(axis=axis, step=step, values=values, source=source)


BEFORE = [  # published before the exporter starts: replayed
    ev("train", 1, "trainer", loss=0.5, tokens=100, groups_accepted=8),
    ev("rollout", 5, "producer-a", reward_mean=0.5, tokens=10, groups=1),
    ev("rollout", 4, "producer-b", reward_mean=1.0, tokens=20, groups=1),
]
AFTER = [  # published while it runs: read through the consumer group
    ev("train", 2, "trainer", loss=0.25, tokens=50, groups_accepted=8, groups_rejected_stale=1),
    ev("rollout", 6, "producer-a", reward_mean=0.0, tokens=5, groups=1),
    ev("eval", 2, "eval", accuracy=0.75, reward_mean=0.75),
    MetricsEvent(
        axis="train", step=3, source="trainer", values={"My Metric/x": 7.0, "step": 99.0}
    ),  # unknown: one sanitised, one colliding
]
REJECTED_ZERO = [r for r in REJECT_REASONS if r != "stale"]
EXPECTED = {
    ("streamer_train_step", ()): 3,
    ("streamer_train_loss", ()): 0.25,
    ("streamer_train_tokens_total", ()): 150,
    ("streamer_train_groups_accepted_total", ()): 16,
    ("streamer_train_groups_rejected_stale_total", ()): 1,
    **{(f"streamer_train_groups_rejected_{r}_total", ()): 0 for r in REJECTED_ZERO},
    ("streamer_train_optimizer_steps_skipped_total", ()): 0,
    ("streamer_train_steps_skipped_total", ()): 0,
    ("streamer_train_groups_skipped_total", ()): 0,
    **{
        (f"streamer_train_{n}_total", ()): 0
        for n in ("audit_groups", "audit_tokens", "audit_tokens_unauditable")
    },
    **{(f"streamer_train_tokens_behind_{k}_total", ()): 0 for k in TOKENS_BEHIND},
    ("streamer_train_my_metric_x", ()): 7.0,
    ("streamer_rollout_step", ()): 6,
    ("streamer_rollout_reward_mean", ()): 0.0,
    ("streamer_rollout_tokens_total", (("producer", "a"),)): 15,
    ("streamer_rollout_tokens_total", (("producer", "b"),)): 20,
    ("streamer_rollout_groups_total", (("producer", "a"),)): 2,
    ("streamer_rollout_groups_total", (("producer", "b"),)): 1,
    ("streamer_eval_step", ()): 2,
    ("streamer_eval_accuracy", (("set", "default"),)): 0.75,  # an event that names no set
    ("streamer_eval_reward_mean", (("set", "default"),)): 0.75,
}


@pytest.fixture
def exporter(redis_url, keys):
    made = []

    def start() -> Exporter:
        ex = Exporter(make_cfg(redis_url, keys.run))
        ex.bootstrap()
        ex.port = ex.serve()
        made.append(ex)
        return ex

    yield start
    for ex in made:
        ex.close()


def test_events_in_exact_series_out(exporter, client, keys, caplog):
    pub = Publisher(client, keys, RunConfig().bus)
    pub.publish_many(keys.metrics, BEFORE)
    caplog.set_level(logging.WARNING, logger="consumers.exporter")
    ex = exporter()
    assert sum(ex.state.events.values()) == len(BEFORE)  # replayed before joining the group
    pub.publish_many(keys.metrics, AFTER)
    again = msgspec.structs.replace(AFTER[-1], id="again")  # a new event (not a retry's copy)
    pub.publish_many(keys.metrics, [again])  # the unknown names again: still one log line each
    drain(ex, len(BEFORE) + len(AFTER) + 1)

    got = axis_series(scrape(ex.port))
    assert got == EXPECTED
    assert all(name in SERIES for name, _ in got if name != "streamer_train_my_metric_x")
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("'My Metric/x'" in w for w in warnings) == 1, warnings
    assert sum("'step'" in w and "ignored" in w for w in warnings) == 1, warnings


def test_stream_health_series(exporter, client, keys):
    pub = Publisher(client, keys, RunConfig().bus)
    now = time.time()
    pub.publish(keys.policy, WeightSync(version=4, step=4, uri="file:///w", sha256="0" * 64, at=now - 2.0))
    pub.publish_many(keys.traj, [ev("train", 0, "x")] * 3)  # any bytes: only counted here
    client.xgroup_create(keys.traj, "trainer", id="0")
    client.xreadgroup("trainer", "t1", {keys.traj: ">"}, count=1)  # 1 pending, 2 lag
    pub.publish(keys.dead, DeadLetter(stream=keys.traj, entry_id="1-0", raw=b"x", reason="bad"))
    client.zadd(keys.producers, {"a": now, "b": now - 60})
    client.set(keys.admitted, 12)
    client.set(keys.version, 4)
    client.hset(keys.limits, mapping={"max_staleness": 1, "groups_per_step": 4})
    pub.publish(keys.metrics, ev("train", 4, "trainer", loss=1.0))
    ex = exporter()
    ex.sample_health()
    s = scrape(ex.port)
    assert s[("streamer_stream_length", (("stream", "traj"),))] == 3
    assert s[("streamer_stream_entries_added_total", (("stream", "traj"),))] == 3
    assert s[("streamer_stream_group_lag", (("group", "trainer"), ("stream", "traj")))] == 2
    assert s[("streamer_stream_group_pending", (("group", "trainer"), ("stream", "traj")))] == 1
    assert s[("streamer_stream_group_entries_read_total", (("group", "trainer"), ("stream", "traj")))] == 1
    assert s[("streamer_stream_group_lag", (("group", METRICS_GROUP), ("stream", "metrics")))] == 1
    assert s[("streamer_dead_letters_total", ())] == 1
    assert s[("streamer_policy_version", ())] == 4
    assert 1.5 < s[("streamer_policy_age_seconds", ())] < 60
    assert s[("streamer_live_producers", ())] == 1
    assert s[("streamer_admitted_groups", ())] == 12
    assert s[("streamer_admission_limit_groups", ())] == (1 + 1) * 4  # groups in flight
    assert 0 <= s[("streamer_train_seconds_since_last_step", ())] < 60
    assert s[("streamer_exporter_health_ok", ())] == 1
    health_names = {
        n for n, _ in s if not n.startswith(("streamer_train_", "streamer_rollout_", "streamer_eval_"))
    }
    assert health_names <= set(SERIES), health_names - set(SERIES)


def test_restart_keeps_counters_consistent(exporter, client, keys):
    pub = Publisher(client, keys, RunConfig().bus)
    first = exporter()
    pub.publish_many(keys.metrics, BEFORE)
    drain(first, len(BEFORE))
    before = axis_series(scrape(first.port))
    assert before[("streamer_train_tokens_total", ())] == 100
    first.close()

    # while it is down: more events, and one entry delivered to it but never acknowledged
    pub.publish_many(keys.metrics, AFTER[:2])
    client.xreadgroup(METRICS_GROUP, "exporter", {keys.metrics: ">"}, count=1)
    second = exporter()
    drain(second, len(BEFORE) + 2)
    for _ in range(3):  # anything left to read is already applied: no double counting
        second.consume(block=0.05)
    after = axis_series(scrape(second.port))
    assert after[("streamer_train_tokens_total", ())] == 150
    assert after[("streamer_train_groups_accepted_total", ())] == 16
    assert after[("streamer_rollout_tokens_total", (("producer", "a"),))] == 15
    assert after[("streamer_rollout_tokens_total", (("producer", "b"),))] == 20
    assert all(after[k] >= v for k, v in before.items() if k[0].endswith("_total")), "a counter went back"
    group = next(g for g in client.xinfo_groups(keys.metrics) if g["name"] == METRICS_GROUP.encode())
    assert (group["pending"], group["lag"]) == (0, 0)


def test_bad_entries_never_crash(exporter, client, keys):
    pub = Publisher(client, keys, RunConfig().bus)
    client.xadd(keys.metrics, {FIELD: b"\xc1 not msgpack"})
    pub.publish(keys.metrics, ev("rollout", 1, "producer-a", tokens=float("nan"), groups=-1, reward_mean=0.5))
    ex = exporter()
    ex.consume(block=0.1)  # the bad entry goes to the dead-letter stream through the group
    s = scrape(ex.port)
    assert s[("streamer_rollout_reward_mean", ())] == 0.5
    assert ("streamer_rollout_tokens_total", (("producer", "a"),)) not in s  # bad increments ignored
    assert client.xlen(keys.dead) == 1


def test_producer_label_is_bounded(exporter, client, keys, monkeypatch):
    monkeypatch.setattr("consumers.metrics_state.MAX_PRODUCER_LABELS", 2)
    pub = Publisher(client, keys, RunConfig().bus)
    pub.publish_many(keys.metrics, [ev("rollout", i, f"producer-p{i}", groups=1) for i in range(5)])
    s = scrape(exporter().port)
    labels = {dict(lb)["producer"]: v for (n, lb), v in s.items() if n == "streamer_rollout_groups_total"}
    assert labels == {"p0": 1, "p1": 1, "other": 3}


@pytest.mark.slow
def test_cli_serves_healthz_and_exits_0_on_sigterm(redis_url, keys, client, tmp_path):
    port = free_port()
    Publisher(client, keys, RunConfig().bus).publish(keys.metrics, ev("eval", 1, "eval", accuracy=1.0))
    cmd = [
        sys.executable,
        "-m",
        "streamer",
        "metrics",
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        body = _wait_healthz(port, proc)
        assert body["ok"] is True and body["events"] == 1
        assert scrape(port)[("streamer_eval_accuracy", (("set", "default"),))] == 1.0
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_healthz(port: int, proc: subprocess.Popen) -> dict:
    def healthz() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return json.loads(r.read())

    ignore = (urllib.error.URLError, ConnectionError)
    return wait_until(
        healthz, timeout=START, what="the exporter's /healthz", watch=Watch(proc), ignore=ignore
    )


@pytest.mark.slow
def test_survives_a_server_restart(private_valkey):
    keys = Keys("restart")
    ex = Exporter(make_cfg(private_valkey.url, keys.run))
    client = connect(private_valkey.url)
    pub = Publisher(client, keys, RunConfig().bus)
    pub.publish(keys.metrics, ev("train", 1, "trainer", tokens=10))
    stop = threading.Event()
    loop = threading.Thread(target=ex.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_until(
            lambda: sum(ex.state.events.values()) == 1 and ex.health_ok, timeout=20, what="the first event"
        )
        private_valkey.kill()
        wait_until(lambda: not ex.health_ok, timeout=20, what="the exporter to notice the outage")
        private_valkey.start()
        connect(private_valkey.url).xadd(keys.metrics, entry(ev("train", 2, "trainer", tokens=5)))
        wait_until(
            lambda: sum(ex.state.events.values()) == 2,
            timeout=20,
            what="the event published after the restart",
        )
        assert ex.state.counters["streamer_train_tokens_total"] == 15
        assert loop.is_alive()
    finally:
        stop.set()
        loop.join(timeout=15)
        ex.close()
    assert not loop.is_alive(), "the loop did not stop within 15 s"


def test_events_that_come_one_by_one_are_read_a_quarter_second_at_a_time(redis_url, client, keys):
    """A producer's events come one a group: the exporter reads what came in the last
    READ_GAP seconds at once, not one read (and one acknowledgement) per event."""
    from consumers import exporter as exporter_module

    ex = Exporter(make_cfg(redis_url, keys.run))
    ex.bootstrap()
    reads, consume = [], ex.consume
    ex.consume = lambda block: reads.append(consume(block)) or reads[-1]
    stop = threading.Event()
    loop = threading.Thread(target=ex.run, args=(stop,), daemon=True)
    loop.start()
    pub = Publisher(client, keys, RunConfig().bus)
    try:
        started = time.monotonic()
        for step in range(1, 41):  # 40 events over ~0.4 s, as a producer's arrive
            pub.publish(keys.metrics, ev("rollout", step, "producer-a", tokens=1))
            time.sleep(0.01)
        wait_until(lambda: sum(ex.state.events.values()) == 40, timeout=20, what="the 40 events applied")
        took = time.monotonic() - started
    finally:
        stop.set()
        loop.join(timeout=15)
        ex.close()
    busy = [n for n in reads if n]
    assert len(busy) <= took / exporter_module.READ_GAP + 2, f"{len(busy)} reads in {took:.2f} s: {busy}"
    assert max(busy) > 1, busy
