"""What a producer asks of the server per group: two round trips in steady state — the claim
with its admission slot and the news of the policy stream, then the publish with the room
check and the group's metrics event — a new policy version included."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from producers.components import build
from producers.producer import Producer
from schemas import MetricsEvent, TrajectoryGroup, WeightSync, decode, encode
from streamer import demo, weights
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import TRAINER_GROUP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import RoundTrips


def _cfg(keys, redis_url, tmp_path, **producer) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 4, "max_new_tokens": 3, "torch_threads": 1, **producer},
        trainer={"groups_per_step": 1000},
    )


def _counted_producer(cfg) -> tuple[Producer, RoundTrips]:
    client = connect(cfg.run.redis_url)  # its own client: every connection of it is counted
    trips = RoundTrips(client)
    task, sampler = build(cfg)
    return Producer(cfg, client=client, producer_id="p1", task=task, sampler=sampler), trips


def _trips_of_a_step(p: Producer, trips: RoundTrips) -> int:
    before = trips.count
    assert p.step() == "published"
    return trips.count - before


def _last(client, key, as_type):
    (_, fields), *_ = client.xrevrange(key, count=1)
    return decode(fields[b"d"], as_type)


def test_a_group_costs_two_round_trips_a_new_policy_version_included(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path)
    p, trips = _counted_producer(cfg)
    assert p.step() == "published"  # the first claim also reads where the cursor stands
    assert [_trips_of_a_step(p, trips) for _ in range(3)] == [2, 2, 2]

    uri, sha = weights.write_version(demo.build_model(seed=5), cfg.weights_dir, 1)
    client.xadd(keys.policy, {b"d": encode(WeightSync(version=1, step=1, uri=uri, sha256=sha))})
    assert _trips_of_a_step(p, trips) == 2, "the claim's reply carries the new version"
    group = _last(client, keys.traj, TrajectoryGroup)
    assert group.policy_version == 1 and {s.version for s in group.samples} == {1}
    assert _last(client, keys.metrics, MetricsEvent).values["weight_loads"] == 1
    assert _trips_of_a_step(p, trips) == 2
    p.close()


def test_the_metrics_event_sent_with_the_group_carries_its_step_and_version_offset(
    client, keys, redis_url, tmp_path
):
    p, _ = _counted_producer(_cfg(keys, redis_url, tmp_path))
    client.set(keys.rollout_step, 41)
    client.set(keys.version, 3)  # the trainer is at version 3; the producer has version 0
    assert p.step() == "published"
    group, event = _last(client, keys.traj, TrajectoryGroup), _last(client, keys.metrics, MetricsEvent)
    assert event.step == 42 and event.axis == "rollout" and event.source == "producer-p1"
    assert event.values["version_offset"] == 3.0 and event.values["groups"] == 1.0
    assert event.values["reward_mean"] == sum(s.reward for s in group.samples) / len(group.samples)
    assert int(client.get(keys.rollout_step)) == 42
    p.close()


def test_a_full_stream_while_stopping_publishes_nothing_and_hands_the_row_back(
    client, keys, redis_url, tmp_path
):
    cfg = replace(_cfg(keys, redis_url, tmp_path), bus={"max_unacked": 2})
    client.xgroup_create(keys.traj, TRAINER_GROUP, id="0", mkstream=True)
    for _ in range(2):
        client.xadd(keys.traj, {b"d": b"waiting for the trainer"})
    p, _ = _counted_producer(cfg)
    p.stop.set()  # stopping: no waiting for room
    assert p.step() == "stopped"
    assert client.xlen(keys.traj) == 2 and client.xlen(keys.metrics) == 0
    assert client.zcard(keys.leases) == 0 and client.lrange(keys.requeue, 0, -1) == [b"0"]
    assert int(client.get(keys.admitted) or 0) == 0, "the row's admission slot was given back"
    p.close()


def test_a_local_models_server_calls_run_on_the_event_loop_and_a_wait_for_room_in_a_thread(
    client, keys, redis_url, tmp_path
):
    """The claim runs on the event loop (a hop to a thread costs more than the call); the
    publish that finds the stream full waits for room in a worker thread, never on the loop."""
    cfg = replace(_cfg(keys, redis_url, tmp_path, concurrency=8), bus={"max_unacked": 2})
    client.xgroup_create(keys.traj, TRAINER_GROUP, id="0", mkstream=True)
    for _ in range(2):
        client.xadd(keys.traj, {b"d": b"waiting for the trainer"})
    p, _ = _counted_producer(cfg)
    threads, claim, wait_for_room = {}, p.trips.claim, p.trips.publisher.wait_for_room

    def claim_here():
        threads["claim"] = threading.get_ident()
        return claim()

    def wait_here(stop):
        threads["wait"] = threading.get_ident()
        entries = client.xreadgroup(TRAINER_GROUP, "trainer", {keys.traj: ">"})[0][1]
        client.xack(keys.traj, TRAINER_GROUP, *[entry_id for entry_id, _ in entries])  # room
        return wait_for_room(stop)

    p.trips.claim, p.trips.publisher.wait_for_room = claim_here, wait_here
    assert p.step() == "published"
    assert threads["claim"] == threading.get_ident(), "the claim left the event loop"
    assert threads["wait"] != threading.get_ident(), "the wait for room held the event loop"
    assert client.xlen(keys.traj) == 3
    p.close()
