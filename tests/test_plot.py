"""`streamer plot` and up's picture: three panels from the snapshot + metrics stream; a
run without metrics is one line and exit 2; without matplotlib `up` only says so."""

from __future__ import annotations

import sys

import pytest

from schemas import MetricsEvent
from streamer import cli
from streamer.bus import Publisher
from streamer.cli import plot
from streamer.config import RunConfig
from streamer.readmodel import History, read_history


def _events(n: int) -> list[MetricsEvent]:
    out = []
    for step in range(1, n + 1):
        train = {"loss": 1.0 / step, "staleness_mean": step % 3 / 2}
        out.append(MetricsEvent(axis="train", step=step, values=train, source="trainer"))
        rollout = {"reward_mean": min(1.0, step / n), "groups": 1.0, "policy_version": float(step - 1)}
        out.append(MetricsEvent(axis="rollout", step=step, values=rollout, source="producer-a"))
        if step % 5 == 0:
            out.append(MetricsEvent(axis="eval", step=step, values={"accuracy": step / n}, source="eval"))
    return out


def test_plot_draws_three_panels_from_the_metrics_stream(client, keys, redis_url, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    Publisher(client, keys, RunConfig().bus).publish_many(keys.metrics, _events(40))
    history = read_history(client, keys)
    assert history.train_step == 40 and len(history.eval_by_version.points) == 8
    out = tmp_path / "run.png"
    assert cli.main(["plot", "--run", keys.run, "--redis-url", redis_url, "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_of_a_run_without_metrics_says_so(redis_url, capsys):
    assert cli.main(["plot", "--run", "no-such-run", "--redis-url", redis_url]) == 2
    assert "no metrics for run 'no-such-run'" in capsys.readouterr().err


def test_up_draws_nothing_without_matplotlib_and_does_not_fail(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert plot.save_quietly(History(), tmp_path / "run.png", title="t") is None
    assert "pip install 'streamer[plot]'" in capsys.readouterr().out
    assert not (tmp_path / "run.png").exists()
