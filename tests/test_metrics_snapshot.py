"""The exporter's state snapshot: the metrics stream is trimmed behind it, and a restarted
exporter (or `up`'s progress view) continues every counter and curve from it."""

from __future__ import annotations

import logging

from consumers.exporter import Exporter
from schemas import MetricsEvent
from streamer.bus import Publisher
from streamer.cli.progress import Progress
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import Keys
from streamer.readmodel.history import MAX_POINTS, Curve


def _cfg(redis_url, run):
    return replace(
        RunConfig(),
        run={"redis_url": redis_url, "name": run},
        metrics={"port": 0, "snapshot_interval": 1.0},
        bus={"block_seconds": 0.1, "socket_timeout": 5.0},
    )


def _events(first_step: int, n: int) -> list[MetricsEvent]:
    out = []
    for step in range(first_step, first_step + n):
        out.append(
            MetricsEvent(
                axis="train", step=step, values={"loss": 1.0 / step, "tokens": 10.0}, source="trainer"
            )
        )
        out.append(
            MetricsEvent(
                axis="rollout",
                step=step,
                values={"reward_mean": 0.5, "groups": 1.0, "tokens": 3.0, "policy_version": float(step)},
                source="producer-a",
            )
        )
    return out


def _drain(ex: Exporter, total: int) -> None:
    for _ in range(200):
        if sum(ex.state.events.values()) >= total:
            return
        ex.consume(block=0.05)
    raise AssertionError(f"exporter applied {ex.state.events}, expected {total} events")


def test_counters_continue_across_a_restart_from_a_snapshot_of_a_trimmed_stream(client, keys, redis_url):
    cfg = _cfg(redis_url, keys.run)
    pub = Publisher(client, keys, cfg.bus)
    first = Exporter(cfg)
    first.bootstrap()
    for k in range(3):  # three snapshot rounds: each trims up to the one before it
        pub.publish_many(keys.metrics, _events(1 + 10 * k, 10))
        _drain(first, 20 * (k + 1))
        first.save_snapshot()
    assert first.trimmed == 40 and client.xlen(keys.metrics) == 20  # only the last round stays
    pub.publish_many(keys.metrics, _events(31, 10))  # after the last snapshot
    _drain(first, 80)
    totals = dict(first.state.counters)
    first.consumer = None  # a crash: no snapshot at exit
    first.client.close()

    second = Exporter(cfg)
    second.bootstrap()
    assert second.state.counters == totals and second.state.counters["streamer_train_tokens_total"] == 400
    assert second.state.events == {"train": 40, "rollout": 40, "eval": 0}
    assert second.state.history.train_step == 40 and len(second.state.history.loss_by_step.points) == 40
    pub.publish_many(keys.metrics, _events(41, 1))
    _drain(second, 82)
    assert second.state.counters["streamer_train_tokens_total"] == 410

    progress = Progress(cfg, target_steps=0, live=False)  # `up` resumed: the same curves
    progress.update()
    assert progress.groups == 41 and progress.train_step == 41
    assert progress.history.reward_by_version.counts() == {v: 1 for v in range(1, 42)}
    second.close()


def test_an_undecodable_snapshot_is_ignored_and_the_stream_replayed(client, keys, redis_url, caplog):
    cfg = _cfg(redis_url, keys.run)
    Publisher(client, keys, cfg.bus).publish_many(keys.metrics, _events(1, 5))
    client.set(keys.metrics_snapshot, b"\x93not a snapshot")
    ex = Exporter(cfg)
    with caplog.at_level(logging.ERROR, logger="streamer.readmodel.saved"):
        ex.bootstrap()
    assert "does not decode" in caplog.text and sum(ex.state.events.values()) == 10
    ex.close()


def test_a_curve_stays_bounded_and_keeps_its_mean():
    curve = Curve()
    for x in range(10 * MAX_POINTS):
        curve.add(x, float(x % 2))
    assert len(curve.points) <= MAX_POINTS and curve.bucket == 16  # four doublings
    assert sum(n for _, n in curve.points.values()) == 10 * MAX_POINTS
    assert all(abs(m - 0.5) < 1e-9 for m in curve.means().values())


def test_the_progress_view_rides_out_a_server_outage(private_valkey, caplog):
    """`up` on an external server or cluster: its supervising loop ticks the progress view
    through a restart or a failover (it once died with the ConnectionError)."""
    cfg = _cfg(private_valkey.url, "outage")
    Publisher(connect(private_valkey.url), Keys("outage"), cfg.bus).publish_many(
        Keys("outage").metrics, _events(1, 3)
    )
    progress = Progress(cfg, target_steps=0, live=False)
    private_valkey.kill()
    with caplog.at_level(logging.WARNING, logger="streamer.cli.progress"):
        progress.tick()
        progress.tick()
    assert [r.getMessage()[:30] for r in caplog.records] == ["progress: server unavailable ("]
    private_valkey.start()
    progress.tick()
    assert progress.train_step == 3 and not progress._down


def test_until_eval_counts_a_score_that_a_later_version_s_followed_before_the_tick(private_valkey):
    """`up --until-eval 0.8`: the evaluator scores versions faster than `up` ticks; v10 at
    0.8 then v20 at 0.7 in one read still reached the target."""
    cfg = _cfg(private_valkey.url, "until")
    progress = Progress(cfg, target_steps=0, live=False)
    evals = [
        MetricsEvent(axis="eval", step=v, values={"accuracy": a}, source="evaluator")
        for v, a in ((0, 0.1), (10, 0.8), (20, 0.7))
    ]
    Publisher(connect(private_valkey.url), Keys("until"), cfg.bus).publish_many(Keys("until").metrics, evals)
    progress.update()
    assert progress.eval_acc == 0.7 and progress.eval_step == 20  # the headline stays the latest
    assert progress.reached_eval(0.8) and not progress.reached_eval(0.81)
    assert not progress.reached_eval(None)
