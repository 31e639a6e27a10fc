"""The bus against a real server: publish, consume, pending drain, claims, dead letters,
backpressure, trimming, and a server restart with AOF."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from schemas import DeadLetter, MetricsEvent, Sample, TrajectoryGroup, WeightSync, decode, encode
from streamer.bus import Consumer, Publisher, trim_acked, unacked
from streamer.config import BusSection
from streamer.connection import connect, replicated
from streamer.errors import BackpressureTimeout, ServerError
from streamer.keys import TRAINER_GROUP
from streamer.tail import Tail

FAST = BusSection(block_seconds=0.2, socket_timeout=5.0, claim_idle_seconds=0.2, read_count=16)


def group(i: int, version: int = 0) -> TrajectoryGroup:
    s = Sample.build(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5, i % 7 + 6],
        logprobs=[-0.5, -0.25, -1.0],
        reward=float(i % 2),
        finish_reason="stop",
        version=version,
    )
    return TrajectoryGroup(
        group_id=f"g{i}",
        row=i,
        epoch=0,
        producer_id="test",
        samples=[s, s],
        policy_version=version,
        created_at=time.time(),
    )


def consumer(client, keys, name="c1", cfg=FAST) -> Consumer:
    return Consumer(client, keys, keys.traj, TRAINER_GROUP, name, as_type=TrajectoryGroup, cfg=cfg)


def read_all(c: Consumer, n: int, timeout: float = 30.0) -> list:  # a bound for hangs
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"read {len(got)} of {n} entries within {timeout}s"
        got += c.read(block=0.1)
    return got


def test_every_event_type_round_trips(client, keys):
    pub = Publisher(client, keys, FAST)
    events = [
        (keys.traj, group(1)),
        (keys.policy, WeightSync(version=3, step=3, uri="file:///w/v3", sha256="a" * 64)),
        (keys.metrics, MetricsEvent(axis="rollout", step=7, values={"reward_mean": 0.5}, source="p")),
        (keys.dead, DeadLetter(stream="s", entry_id="1-0", raw=b"\x00", reason="why")),
    ]
    for stream, event in events:
        pub.publish(stream, event)
    for stream, event in events:
        assert Tail(client, stream, as_type=type(event)).poll() == [event]
        assert decode(client.xrange(stream)[0][1][b"d"]) == event  # the union decoder too


def test_publish_many_is_one_round_trip_in_order(client, keys):
    ids = Publisher(client, keys, FAST).publish_many(keys.traj, [group(i) for i in range(10)])
    assert ids == sorted(ids) and len(set(ids)) == 10
    got = read_all(consumer(client, keys), 10)
    assert [d.event.group_id for d in got] == [f"g{i}" for i in range(10)]


def test_pending_entries_are_redelivered_to_a_restarted_consumer(client, keys):
    Publisher(client, keys, FAST).publish_many(keys.traj, [group(i) for i in range(5)])
    first = consumer(client, keys)
    got = read_all(first, 5)
    first.ack([got[0].id, got[1].id])  # "crash" with three entries unacknowledged
    again = consumer(client, keys)  # same name: a restarted process
    redelivered = read_all(again, 3)
    assert [d.event.group_id for d in redelivered] == ["g2", "g3", "g4"]
    assert all(d.deliveries == 2 for d in redelivered)
    again.ack(d.id for d in redelivered)
    assert again.read(block=0.1) == [] and unacked(client, keys.traj) == 0


def test_idle_entries_of_a_dead_consumer_are_claimed(client, keys):
    Publisher(client, keys, FAST).publish_many(keys.traj, [group(i) for i in range(3)])
    dead = consumer(client, keys, "dead")
    read_all(dead, 3)  # never acknowledged: its process is gone
    live = consumer(client, keys, "live")
    claimed = read_all(live, 3)  # after claim_idle_seconds
    assert sorted(d.event.group_id for d in claimed) == ["g0", "g1", "g2"]
    pending = client.xpending(keys.traj, TRAINER_GROUP)
    assert [(c["name"], c["pending"]) for c in pending["consumers"]] == [(b"live", 3)]


def test_poison_bytes_go_to_dead_letters_and_the_consumer_continues(client, keys):
    pub = Publisher(client, keys, FAST)
    pub.publish(keys.traj, group(1))
    client.xadd(keys.traj, {b"d": b"\xc1garbage"})
    client.xadd(keys.traj, {b"other": b"no d field"})
    wrong_type = encode(WeightSync(version=1, step=1, uri="x", sha256="b" * 64))
    client.xadd(keys.traj, {b"d": wrong_type})  # right codec, wrong event type
    pub.publish(keys.traj, group(2))
    c = consumer(client, keys)
    got = read_all(c, 2)
    assert [d.event.group_id for d in got] == ["g1", "g2"]
    letters = Tail(client, keys.dead, as_type=DeadLetter).poll()
    assert len(letters) == 3 and c.dead_lettered == 3
    assert letters[0].raw == b"\xc1garbage" and letters[0].stream == keys.traj
    assert "malformed msgpack" in letters[0].reason
    assert letters[1].reason == "entry has no `d` field"
    assert "invalid TrajectoryGroup" in letters[2].reason
    # dead-lettered entries are acknowledged: only the two good ones stay pending
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 2


def test_entries_delivered_too_often_are_dead_lettered(client, keys):
    cfg = BusSection(block_seconds=0.2, socket_timeout=5.0, max_deliveries=2, claim_idle_seconds=60)
    Publisher(client, keys, cfg).publish(keys.traj, group(1))
    for attempt in (1, 2):  # a consumer that crashes while handling the entry, twice
        got = read_all(consumer(client, keys, cfg=cfg), 1)
        assert got[0].deliveries == attempt
    third = consumer(client, keys, cfg=cfg)
    assert third.read(block=0.1) == []
    (letter,) = Tail(client, keys.dead, as_type=DeadLetter).poll()
    assert letter.reason == "delivered 3 times (max 2)"
    assert client.xpending(keys.traj, TRAINER_GROUP)["pending"] == 0


def test_backpressure_blocks_until_the_trainer_acknowledges(client, keys):
    cfg = BusSection(max_unacked=4, block_seconds=0.2, socket_timeout=5.0, backpressure_timeout=30)
    pub = Publisher(client, keys, cfg)
    c = consumer(client, keys, cfg=cfg)
    pub.publish_many(keys.traj, [group(i) for i in range(4)])
    done = threading.Event()

    def publish_fifth():
        pub.wait_for_room()
        pub.publish(keys.traj, group(4))
        done.set()

    t = threading.Thread(target=publish_fifth, daemon=True)
    t.start()
    assert not done.wait(0.5), "published past max_unacked"
    got = read_all(c, 4)
    assert not done.wait(0.3), "reading without acknowledging must not make room"
    c.ack([got[0].id])
    assert done.wait(10), "publisher did not resume after an acknowledgement"
    t.join(5)
    assert client.xlen(keys.traj) == 5 and pub.waited_seconds > 0


def test_backpressure_gives_up_with_a_clear_error(client, keys):
    cfg = BusSection(max_unacked=1, block_seconds=0.2, socket_timeout=5.0, backpressure_timeout=0.3)
    pub = Publisher(client, keys, cfg)
    pub.publish(keys.traj, group(0))
    with pytest.raises(BackpressureTimeout, match="is the trainer running"):
        pub.wait_for_room()


def test_trim_removes_only_what_every_group_acknowledged(client, keys):
    Publisher(client, keys, FAST).publish_many(keys.traj, [group(i) for i in range(6)])
    assert trim_acked(client, keys.traj) == 0  # no group yet: nobody has read anything
    trainer = consumer(client, keys)
    audit = Consumer(client, keys, keys.traj, "audit", "a", as_type=TrajectoryGroup, cfg=FAST)
    t_got, a_got = read_all(trainer, 6), read_all(audit, 6)
    trainer.ack(d.id for d in t_got[:4])
    audit.ack(d.id for d in a_got[:2])
    assert trim_acked(client, keys.traj) == 2  # the audit group still needs g2..g5
    audit.ack(d.id for d in a_got[2:5])
    assert trim_acked(client, keys.traj) == 2  # now the trainer's pending g4 is the oldest
    remaining = [decode(f[b"d"]).group_id for _, f in client.xrange(keys.traj)]
    assert remaining == ["g4", "g5"]


@pytest.mark.slow
def test_unix_socket_and_password(tmp_path):
    from streamer.server import EmbeddedServer

    with EmbeddedServer(tmp_path / "v", unix_socket=True, password="s3cret") as server:
        assert server.url.startswith("unix://")
        c = connect(server.url)
        assert c.ping()
        with pytest.raises(Exception, match="authentication|NOAUTH|WRONGPASS|invalid"):
            connect(server.url.replace("s3cret", "wrong"))


@pytest.mark.slow
def test_consumer_survives_a_server_restart_with_aof(private_valkey, keys):
    client = connect(private_valkey.url, socket_timeout=5.0)
    pub = Publisher(client, keys, FAST)
    c = consumer(client, keys)
    pub.publish_many(keys.traj, [group(i) for i in range(4)])
    got = read_all(c, 4)
    c.ack(d.id for d in got[:2])
    private_valkey.kill()  # appendfsync always: everything acknowledged is on disk
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
    private_valkey.start()
    from streamer.connection import retrying

    restarted = retrying(lambda: consumer(client, keys), what="reconnect", give_up_after=20)
    redelivered = read_all(restarted, 2)
    assert [d.event.group_id for d in redelivered] == ["g2", "g3"]
    assert client.xlen(keys.traj) == 4
    pub.publish(keys.traj, group(9))
    assert [d.event.group_id for d in read_all(restarted, 1)] == ["g9"]


def test_min_replicas_without_a_replica_warns_then_gives_up_with_the_key_named(client, keys, caplog):
    """`bus.min_replicas` on a server with no replica: nothing counts as held; the writer
    waits with a warning per `replica_timeout`, and gives up (a stopping trainer) clearly."""
    if client.info("replication").get("connected_slaves", 0):
        pytest.skip("this server has replicas")
    replicated(client, keys.replicated, BusSection(min_replicas=0, replica_timeout=0.1))  # no WAIT
    with pytest.raises(ServerError, match=r"0 of 1 replica\(s\) \(bus.min_replicas\)"):
        replicated(
            client, keys.replicated, BusSection(min_replicas=1, replica_timeout=0.1), give_up_after=0.3
        )
    warnings = [r for r in caplog.records if "bus.min_replicas" in r.getMessage()]
    assert len(warnings) == 2  # after 0.1 s and 0.2 s; at 0.3 s it gave up
