"""A cluster that goes down for a while is an outage every role waits out.

Three masters without replicas. A master that does not serve the run is paused (SIGSTOP): the
other masters mark it failed after the node timeout, and every node then answers every
command with CLUSTERDOWN (its slots are not served) until it answers again. A producer in the
middle of a row and the metrics exporter keep running through it and carry on once the
paused node is resumed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from harness import report
from waits import wait_until

from consumers.exporter import Exporter
from producers.components import Task, build
from producers.producer import Producer
from schemas import MetricsEvent
from streamer import demo
from streamer.admission import Admission
from streamer.bus import Publisher, unacked
from streamer.config import RunConfig, replace
from streamer.connection import TRANSIENT, connect
from streamer.keys import Keys
from streamer.server import LocalCluster, _client, _cluster_info

pytestmark = pytest.mark.slow
OUTAGE = 60.0  # bound on the cluster noticing the pause, and on its recovery


def _state(node) -> str:
    with _client(node) as c:
        return _cluster_info(c)["cluster_state"]


def test_a_paused_master_is_waited_out_by_producer_and_exporter(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with LocalCluster(tmp_path / "cluster", masters=3, replicas=0, node_timeout=1.0) as cluster:
        seed = cluster.nodes[0]  # the node in the URL stays up
        keys = next(
            k for k in map(Keys, (f"down{i}" for i in range(64))) if cluster.master_of(k.traj) != seed
        )
        home = cluster.master_of(keys.traj)
        victim = next(n for n in cluster.nodes if n not in (seed, home))
        client = connect(cluster.url)
        cfg = replace(
            RunConfig(),
            run={"name": keys.run, "redis_url": cluster.url, "data_dir": str(tmp_path / "data")},
            producer={"group_size": 4, "max_new_tokens": 2, "torch_threads": 1, "max_groups": 2},
            trainer={"groups_per_step": 1000},
        )
        exporter = Exporter(cfg)
        stop = threading.Event()
        exporting = threading.Thread(target=exporter.run, args=(stop,), daemon=True)
        exporting.start()

        down = threading.Event()  # the producer's first row holds its reward until the cluster is down

        def reward(row, text, sample=None):
            down.wait(OUTAGE)
            return demo.reward(row, text, sample)

        task, sampler = build(cfg)
        task = Task(rows=task.rows, renderer=task.renderer, reward_fn=reward, reward_path="test")
        producer = Producer(cfg, client=connect(cluster.url), producer_id="p0", task=task, sampler=sampler)
        result: dict = {}

        def produce() -> None:
            try:
                result["code"] = producer.run()
            except BaseException as e:  # the old failure: the outage ended the producer
                result["error"] = repr(e)

        producing = threading.Thread(target=produce, daemon=True)
        producing.start()
        os.kill(victim.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            wait_until(lambda: _state(home) == "fail", timeout=OUTAGE, what="the cluster to go down")
            noticed = time.monotonic() - paused
            # what failed the roles before: a cluster that is down answers CLUSTERDOWN, a
            # ResponseError too, which was taken for a bad value or an empty stream
            with pytest.raises(TRANSIENT):
                Admission(client, keys, max_staleness=0, groups_per_step=1).try_admit()
            with pytest.raises(TRANSIENT):
                unacked(client, keys.traj)
            down.set()  # the producer publishes now, into the outage
            wait_until(
                lambda: any(f"producer {producer.id}" in r.getMessage() for r in caplog.records),
                timeout=OUTAGE,
                what="the producer waiting out the outage",
            )
            wait_until(
                lambda: (
                    any(r.name == "consumers.exporter" for r in caplog.records) or not exporting.is_alive()
                ),
                timeout=OUTAGE,
                what="the exporter noticing the outage",
            )
            assert producing.is_alive() and "error" not in result, result
            assert exporting.is_alive(), "the exporter ended in the outage"
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        wait_until(lambda: _state(home) == "ok", timeout=OUTAGE, what="the cluster to recover")
        down_for = time.monotonic() - paused
        producing.join(OUTAGE)
        assert result == {"code": 0}, result
        assert client.xlen(keys.traj) == 2
        Publisher(client, keys, cfg.bus).publish(
            keys.metrics, MetricsEvent(axis="train", step=1, values={"loss": 1.0}, source="test")
        )
        wait_until(
            lambda: exporter.state.events["train"] == 1,
            timeout=OUTAGE,
            what="the exporter applying an event after the outage",
        )
        assert exporting.is_alive()
        stop.set()
        exporting.join(10)
        exporter.close()
        report("cluster-down", noticed_seconds=round(noticed, 1), down_seconds=round(down_for, 1), groups=2)
