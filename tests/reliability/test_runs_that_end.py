"""Runs that cannot go on end in order and say why: the data runs out before the steps, every
step is skipped for a non-finite gradient, every row was set aside under a broken config.
Each through `streamer up` on a server of the test's own, so `streamer status` can read the
run after `up` has ended. And a dataset cursor deleted under a producer hands out no row
twice."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from harness import report
from producing import make_producer, run_cfg
from trainer_data import REPO

from consumers import checkpoint
from producers.trips import Outcome
from schemas import DeadLetter, MetricsEvent, TrajectoryGroup, decode
from streamer import demo, rows
from streamer.bus import entry_event
from streamer.config import write_toml
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow

UP_TIMEOUT = 240  # seconds: each run below takes 10-30 s on two cores


def _config(tmp_path: Path, run: str, **sections: dict) -> Path:
    """The demo's config for run ``run``, with ``sections``' keys changed."""
    tree = msgspec.to_builtins(demo.config())
    tree["run"].update(name=run, data_dir=str(tmp_path / "data"))
    for name, fields in sections.items():
        tree[name].update(fields)
    return write_toml(tmp_path / f"{run}-{len(list(tmp_path.glob('*.toml')))}.toml", tree)


def _streamer(
    *args: str, timeout: float = UP_TIMEOUT, path: Path | None = None
) -> subprocess.CompletedProcess:
    """`streamer ARGS`, with ``path`` (a user's modules) on the Python path."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), str(path or ""), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "streamer", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"`streamer {' '.join(args)}` did not end within {timeout}s; its output:\n{out[-3000:]}")


def _up(config: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    up = ("up", "--config", str(config), "--redis-url", url, "--no-progress", "--producers", "1")
    return _streamer(*up, *args, path=config.parent)


def _status(config: Path, url: str) -> subprocess.CompletedProcess:
    return _streamer("status", "--config", str(config), "--redis-url", url, timeout=60)


def test_a_run_whose_data_runs_out_before_its_steps_ends_in_order_and_says_so(private_valkey, tmp_path):
    url = private_valkey.url
    config = _config(tmp_path, "short", producer={"epochs": 1})
    up = _up(config, url, "--steps", "200")
    out = up.stdout + up.stderr
    assert up.returncode == 0, out[-3000:]
    assert "the data is exhausted: every row of producer.epochs = 1 is sampled" in out, out[-3000:]
    summary = out[out.index("streamer up: summary") :]
    assert "ended              the data is exhausted" in summary, summary
    trained = int(summary.split("steps trained")[1].split()[0])
    assert 0 < trained < 200, summary
    client, keys = connect(url), Keys("short")
    n_rows = int(client.get(keys.row_count))
    assert int(client.get(keys.cursor)) == n_rows, "one epoch: every row's ticket handed out once"
    # every group that arrived was trained or rejected: nothing waits, nothing is pending
    assert client.xpending(keys.traj, "trainer")["pending"] == 0
    newest = checkpoint.latest(Path(tmp_path / "data" / "short" / "checkpoints"))
    assert newest is not None and newest[1].step == trained, "the final checkpoint covers every step"
    status = _status(config, url)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "done: the data is exhausted" in status.stdout and "all trained" in status.stdout, status.stdout

    # resumed with the data still exhausted: nothing to train is an error that says why
    again = _up(config, url, "--steps", "200")
    assert again.returncode == 1, again.stdout + again.stderr
    assert "no step was trained: the data is exhausted" in again.stderr, again.stderr
    assert "Raise producer.epochs" in again.stderr
    report(
        "data_exhausted",
        rows=n_rows,
        steps_trained=trained,
        exit_codes=f"{up.returncode},{again.returncode}",
    )


# losses of one's own (trainer.loss = "bad_losses:NAME"), in a module the roles import
BAD_LOSSES = """
def never_finite(*, logp, prox_logp, sampler_logp, advantages, weights):
    return logp * float("nan")  # a gradient that is never finite


def huge(*, logp, prox_logp, sampler_logp, advantages, weights):
    return logp * 1e38  # a gradient whose norm overflows
"""


@pytest.mark.parametrize("loss", ["never_finite", "huge"])
def test_a_loss_that_is_never_finite_trains_nothing_and_stops_the_run_naming_the_cause(
    private_valkey, tmp_path, loss
):
    url, keys = private_valkey.url, Keys(f"nan-{loss}")
    (tmp_path / "bad_losses.py").write_text(BAD_LOSSES)
    config = _config(tmp_path, keys.run, trainer={"loss": f"bad_losses:{loss}", "max_skipped_steps": 3})
    up = _up(config, url, "--steps", "15")
    out = up.stdout + up.stderr
    assert up.returncode == 1, out[-3000:]
    assert "3 trainer steps in a row were skipped (trainer.max_skipped_steps = 3)" in out, out[-3000:]
    assert "the gradient was not finite" in out
    summary = out[out.index("streamer up: summary") :]
    assert "steps trained      0 (3 skipped" in summary, summary
    client = connect(url)
    dead = [entry_event(f, DeadLetter) for _, f in client.xrange(keys.dead)]
    skipped = [d for d in dead if d.reason.startswith("trainer step skipped: the gradient was not finite")]
    per_step = demo.config().trainer.groups_per_step
    assert len(skipped) == 3 * per_step, [d.reason for d in dead]
    # no group of a skipped step is claimed as trained: no checkpoint lists one
    ckpt = checkpoint.latest(Path(tmp_path / "data" / keys.run / "checkpoints"))
    assert ckpt is None or not ckpt[1].group_ids, "a skipped step's groups were checkpointed as trained"
    status = _status(config, url)
    assert status.returncode == 1, status.stdout
    assert "skipped     3 trainer steps changed no weights" in status.stdout, status.stdout
    assert "trainer" in status.stdout and "in a row were skipped" in status.stdout, status.stdout
    events = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    counted = sum(e.values.get("steps_skipped", 0) for e in events if e.axis == "train")
    assert counted == 3, "each skipped step is one steps_skipped count on the train axis"
    report(f"skipped_steps_{loss}", steps_trained=0, skipped=3, dead_lettered=len(skipped), exit_code=1)


def test_rows_set_aside_under_a_broken_config_come_back_once_it_is_fixed(private_valkey, tmp_path):
    url, keys = private_valkey.url, Keys("poisoned")
    client = connect(url)
    good = _config(tmp_path, keys.run, producer={"defer_failed_after": 1})
    first = _up(good, url, "--steps", "2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    ckpt_dir = Path(tmp_path / "data" / keys.run / "checkpoints")
    assert checkpoint.latest(ckpt_dir)[1].step == 2

    # a temperature that makes every sample of a row the same: every row set aside
    broken = _config(tmp_path, keys.run, producer={"defer_failed_after": 1, "temperature": 1e-30})
    poisoned = _up(broken, url, "--steps", "10")
    assert poisoned.returncode == 1, (poisoned.stdout + poisoned.stderr)[-3000:]
    assert "no step was trained: every row is set aside" in poisoned.stderr, poisoned.stderr
    assert "nothing left to teach" in poisoned.stderr and "--reset-rows" in poisoned.stderr
    aside = rows.counts(client, keys)
    assert aside.nothing_to_teach and aside.active == 0, aside
    assert checkpoint.latest(ckpt_dir)[1].step == 2, "the checkpoint is kept"

    # the fixed config: the rows come back by themselves, training goes on from step 2
    fixed = _up(good, url, "--steps", "4")
    assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-3000:]
    log = (tmp_path / "data" / keys.run / "logs" / "produce-0.log").read_text()
    assert "temperature 1e-30 -> 1.0" in log and f"{aside.total} rows set aside are active again" in log, log[
        -2000:
    ]
    assert checkpoint.latest(ckpt_dir)[1].step == 4

    # the same config again, rows set aside by hand: `streamer rows reset` brings them back
    _set_aside(client, keys, aside.total)
    shown = _streamer("rows", "--config", str(good), "--redis-url", url, timeout=60)
    assert f"0 active, 0 solved, {aside.total} unsolvable" in shown.stdout, shown.stdout + shown.stderr
    reset = _streamer("rows", "reset", "--config", str(good), "--redis-url", url, timeout=60)
    assert reset.returncode == 0 and f"{aside.total} rows set aside are active again" in reset.stdout, (
        reset.stdout
    )
    assert rows.counts(client, keys).active == aside.total
    assert checkpoint.latest(ckpt_dir)[1].step == 4
    report("rows_come_back", rows=aside.total, set_aside_by_broken_config=aside.unsolvable + aside.solved)


def _set_aside(client, keys: Keys, total: int) -> None:
    """Rows 0 .. total - 1 set aside by hand, as unsolvable."""
    for row in range(total):
        client.hset(keys.rows, row, "9,0,0.000")
        client.sadd(keys.rows_unsolvable, row)


def test_up_reset_rows_brings_back_rows_set_aside(private_valkey, tmp_path):
    url, keys = private_valkey.url, Keys("reset")
    client = connect(url)
    config = _config(tmp_path, keys.run, producer={"defer_failed_after": 1})
    first = _up(config, url, "--steps", "1")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    total = int(client.get(keys.row_count))
    _set_aside(client, keys, total)  # every row, with the same config
    again = _up(config, url, "--steps", "2", "--reset-rows")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"{total} rows set aside are active again" in again.stdout, again.stdout
    assert checkpoint.latest(Path(tmp_path / "data" / keys.run / "checkpoints"))[1].step == 2


def test_a_deleted_dataset_cursor_hands_out_no_row_twice(private_valkey, tmp_path, caplog):
    url, keys = private_valkey.url, Keys("cursor")
    client = connect(url)
    cfg = run_cfg(keys, url, tmp_path, epochs=1, defer_after=0, defer_failed_after=0, defer_pass_rate=0)
    p = make_producer(cfg, client)
    total = len(p.task.rows)
    assert [p.step() for _ in range(5)] == [Outcome.PUBLISHED] * 5
    client.delete(keys.cursor)  # an operator's mistake
    with caplog.at_level(logging.WARNING, logger="producers.trips"):
        outcomes = [p.step() for _ in range(total + 5)]
    p.close()
    published = [decode(f[b"d"], TrajectoryGroup).row for _, f in client.xrange(keys.traj)]
    assert sorted(published) == list(range(total)), "a row was sampled twice (or not at all) in one epoch"
    assert outcomes.count(Outcome.EXHAUSTED) >= 1
    said = [r.getMessage() for r in caplog.records if "went back" in r.getMessage()]
    assert len(said) == 1 and "went back from 5 to 1" in said[0], said
    report("deleted_cursor", rows=total, published=len(published), warnings=len(said))
