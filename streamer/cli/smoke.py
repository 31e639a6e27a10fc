"""`streamer smoke`: every event type through a real server and back, in one second."""

from __future__ import annotations

import tempfile
import time

from schemas import DeadLetter, MetricsEvent, Sample, TrajectoryGroup, WeightSync
from streamer.bus import Consumer, Publisher
from streamer.connection import connect
from streamer.keys import TRAINER_GROUP, Keys
from streamer.server import EmbeddedServer
from streamer.tail import Tail


def round_trip(url: str, keys: Keys, cfg) -> list[str]:
    client = connect(url, socket_timeout=cfg.socket_timeout)
    pub = Publisher(client, keys, cfg)
    sample = Sample.build(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        reward=1.0,
        finish_reason="stop",
        version=0,
    )
    group = TrajectoryGroup(
        group_id="smoke-0",
        row=0,
        epoch=0,
        producer_id="smoke",
        samples=[sample, sample],
        policy_version=0,
        created_at=time.time(),
    )
    sync = WeightSync(version=1, step=1, uri="file:///dev/null", sha256="0" * 64)
    metric = MetricsEvent(axis="train", step=1, values={"loss": 0.5}, source="smoke")
    pub.publish(keys.traj, group)
    pub.publish(keys.policy, sync)
    pub.publish(keys.metrics, metric)
    consumer = Consumer(client, keys, keys.traj, TRAINER_GROUP, "smoke", as_type=TrajectoryGroup, cfg=cfg)
    got = consumer.read(block=1.0)
    assert [d.event for d in got] == [group], got
    consumer.ack(d.id for d in got)
    assert Tail(client, keys.policy, as_type=WeightSync).latest() == sync
    assert Tail(client, keys.metrics, as_type=MetricsEvent).poll() == [metric]
    client.xadd(keys.traj, {b"d": b"\xc1not msgpack"})
    assert consumer.read(block=1.0) == []
    assert Tail(client, keys.dead, as_type=DeadLetter).latest().reason.startswith("malformed")
    return ["TrajectoryGroup", "WeightSync", "MetricsEvent", "DeadLetter"]


def main(cfg, args) -> int:
    with tempfile.TemporaryDirectory() as d:
        url = cfg.run.redis_url
        server = None if url else EmbeddedServer(d).start()
        try:
            names = round_trip(url or server.url, Keys(f"smoke{int(time.time())}"), cfg.bus)
        finally:
            if server:
                server.stop()
    where = "the embedded server" if server else "the server"
    print(f"smoke ok: {', '.join(names)} round-tripped through {where}")
    return 0
