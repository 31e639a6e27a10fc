"""A run on a Valkey cluster: three masters started here, slots split evenly, a replica each.

Every key of a run carries the run's hash tag (``streamer:{run}:…``), so each Lua script and
MULTI of a run lands on one node. The bus, lease, admission and status tests run again
unchanged against a ``redis+cluster://`` URL (the fixtures below replace the single server),
and `streamer up` trains the demo on the cluster. With ``bus.min_replicas``, a read entry is
acted on only once a replica holds it. (A master's failover under a running trainer and
producer is in tests/reliability/test_failover.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from redis.cluster import RedisCluster

# The same tests, collected again here with this module's `redis_url` (the cluster).
from test_bus import (  # noqa: F401
    test_backpressure_blocks_until_the_trainer_acknowledges,
    test_entries_delivered_too_often_are_dead_lettered,
    test_every_event_type_round_trips,
    test_idle_entries_of_a_dead_consumer_are_claimed,
    test_pending_entries_are_redelivered_to_a_restarted_consumer,
    test_poison_bytes_go_to_dead_letters_and_the_consumer_continues,
    test_publish_many_is_one_round_trip_in_order,
    test_trim_removes_only_what_every_group_acknowledged,
)
from test_producer import (  # noqa: F401
    test_admission_counter_is_exact_under_concurrency,
    test_concurrent_producers_never_exceed_the_admission_rule,
    test_groups_and_metrics_as_published,
)
from test_status import test_json_for_scripts  # noqa: F401
from waits import wait_until

from schemas import WeightSync
from streamer.bus import Consumer, entry
from streamer.config import BusSection
from streamer.connection import connect
from streamer.keys import Keys
from streamer.server import LocalCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1) as c:
        yield c


@pytest.fixture
def redis_url(cluster) -> str:
    return cluster.url


def test_a_cluster_url_gives_a_cluster_client_and_a_run_lives_on_one_slot(cluster, keys: Keys):
    client = connect(cluster.url)
    assert isinstance(client, RedisCluster)
    names = [keys.traj, keys.policy, keys.metrics, keys.dead, keys.cursor, keys.leases, keys.admitted]
    assert len({client.keyslot(n) for n in names}) == 1
    # runs spread over the nodes: 24 run names land on more than one master
    slots = {client.keyslot(Keys(f"r{i}").traj) for i in range(24)}
    nodes = {client.nodes_manager.get_node_from_slot(s).name for s in slots}
    assert len(nodes) > 1, nodes


def test_with_min_replicas_a_read_waits_until_a_replica_holds_the_entry(cluster, keys: Keys, caplog):
    client = connect(cluster.url)
    cfg = BusSection(min_replicas=1, replica_timeout=0.2)
    consumer = Consumer(client, keys, keys.policy, "g", "c", as_type=WeightSync, cfg=cfg)
    (replica,) = cluster.replicas_of(cluster.master_of(keys.policy))
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(consumer.read(block=0.1)), daemon=True)
    os.kill(replica.proc.pid, signal.SIGSTOP)  # the replica stops taking the master's writes
    try:
        client.xadd(keys.policy, entry(WeightSync(version=1, step=1, uri="file:///v1", sha256="0" * 64)))
        reader.start()
        wait_until(
            lambda: any("bus.min_replicas" in r.getMessage() for r in caplog.records),
            timeout=30,
            what="the reader's warning that no replica holds the entry",
        )
        assert reader.is_alive() and not got, "an entry no replica holds was handed over"
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    reader.join(30)
    assert [d.event.version for d in got] == [1]


def test_up_trains_the_demo_on_the_cluster(cluster, tmp_path):
    steps = 30
    proc = subprocess.run(
        [sys.executable, "-m", "streamer", "up", "--redis-url", cluster.url, "--data-dir", str(tmp_path)]
        + ["--run", "clusterdemo", "--steps", str(steps), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"steps trained      {steps}" in proc.stdout, proc.stdout[-3000:]
    status = subprocess.run(
        [sys.executable, "-m", "streamer", "status", "--redis-url", cluster.url, "--run", "clusterdemo"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    state = json.loads(status.stdout)
    assert state["policy"]["version"] == steps, status.stdout
