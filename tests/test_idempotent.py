"""A write whose reply is lost is retried (redis-py re-sends it on a new connection), so
the server runs it twice: a version announcement adds no second copy (its script refuses
a version already announced) and a metrics event's copy carries the same id, which the
exporter's state and `up`'s progress view skip."""

from __future__ import annotations

import logging
import urllib.parse

import pytest
from lossy_proxy import LossyProxy

from consumers.metrics_state import State
from consumers.versions import VersionPublisher
from schemas import MetricsEvent, WeightSync
from streamer import demo
from streamer.bus import Publisher, entry_event
from streamer.cli.progress import Progress
from streamer.config import RunConfig, replace
from streamer.connection import connect


@pytest.fixture
def proxy(redis_url):
    parts = urllib.parse.urlsplit(redis_url)
    if parts.scheme != "redis" or parts.password:
        pytest.skip("the proxy speaks plain TCP without AUTH")
    p = LossyProxy(parts.hostname, parts.port)
    yield p
    p.close()


def test_a_metrics_event_written_twice_by_a_retry_counts_once(proxy, keys, client, redis_url):
    lossy = connect(proxy.url(), socket_timeout=5.0)
    publisher = Publisher(lossy, keys, RunConfig().bus)
    first = MetricsEvent(axis="rollout", step=1, values={"groups": 1.0}, source="producer-p0")
    proxy.drop_next_reply.set()
    publisher.publish(keys.metrics, first)  # its reply is lost; redis-py sends it again
    publisher.publish(keys.metrics, MetricsEvent(axis="rollout", step=2, values={"groups": 1.0}, source="p"))
    rows = client.xrange(keys.metrics)
    events = [entry_event(f, MetricsEvent) for _, f in rows]
    assert proxy.dropped == 1 and len(rows) == 3, "the lost reply's command did not run twice"
    assert events[0].id == events[1].id != events[2].id
    state = State()
    applied = [state.apply(i.decode(), e) for (i, _), e in zip(rows, events)]
    assert applied == [True, False, True] and state.duplicates == 1
    assert state.events["rollout"] == 2
    assert sum(v for (n, _), v in state.labelled.items() if n == "streamer_rollout_groups_total") == 2
    cfg = replace(RunConfig(), run={"name": keys.run, "redis_url": redis_url})
    progress = Progress(cfg, target_steps=0, live=False)
    progress.update()
    assert progress.groups == 2
    lossy.close()


def test_a_version_announced_twice_by_a_retry_is_on_the_policy_stream_once(
    proxy, keys, client, tmp_path, caplog
):
    lossy = connect(proxy.url(), socket_timeout=5.0)
    publisher = VersionPublisher(lossy, keys, root=tmp_path, keep_versions=3, protect=lambda: -1)
    model = demo.build_model(seed=1)
    publisher.publish_now(model, version=0, step=0)
    proxy.drop_next_reply.set()
    with caplog.at_level(logging.INFO, logger="consumers.versions"):
        publisher.publish_now(model, version=1, step=1)  # the script ran; its reply is lost
    publisher.close()
    assert "version 1 was already announced" in caplog.text  # the retry ran the script again
    versions = [entry_event(f, WeightSync).version for _, f in client.xrange(keys.policy)]
    assert proxy.dropped == 1
    assert versions == [0, 1] and int(client.get(keys.version)) == 1
    lossy.close()
