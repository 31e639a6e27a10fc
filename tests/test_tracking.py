"""`streamer track` against a real server: metrics into TensorBoard and W&B (offline) files,
read back with each one's own reader; a tracker killed mid-run writes nothing twice; `up`
starts it."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
from bounds import RUN, START
from needs import in_ci
from runs import Up
from waits import Watch, wait_until

from consumers import tracking_wandb
from consumers.archive import RotatingWriter
from consumers.sample_tables import ArchiveTail, SampleTables
from consumers.tracker import Tracker
from schemas import MetricsEvent
from streamer import demo
from streamer.bus import Publisher, parse_id
from streamer.config import RunConfig, replace, write_toml
from streamer.errors import ConfigError

try:  # both come with the test extra; CI installs it, so there a missing one fails
    import wandb  # noqa: F401
    from tensorboard.backend.event_processing import event_file_loader as tb_loader
except ImportError as e:
    if in_ci():
        raise
    pytest.skip(f"{e.name} is not installed: pip install -e '.[test]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("tensorboard", "wandb")


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    """W&B writes files only (no network here), and keeps its own files in the test's dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def make_cfg(redis_url: str, run: str, data_dir: Path, backend: str, **tracking) -> RunConfig:
    return replace(
        RunConfig(),
        run={"redis_url": redis_url, "name": run, "data_dir": str(data_dir)},
        tracking={"backend": backend, "mode": "offline" if backend == "wandb" else "", **tracking},
        bus={"block_seconds": 0.2, "socket_timeout": 5.0},
    )


def ev(axis: str, step: int, source: str = "test", eval_set: str = "", **values: float) -> MetricsEvent:
    return MetricsEvent(axis=axis, step=step, values=values, source=source, eval_set=eval_set)


EVENTS = [
    ev("train", 1, loss=0.5, version=1.0),
    ev("rollout", 3, "producer-a", reward_mean=0.25),
    ev("rollout", 3, "producer-b", reward_mean=0.75),  # two producers at one rollout step
    ev("train", 2, loss=0.25, version=2.0),
    ev("eval", 2, "eval", accuracy=0.5, reward_mean=0.5),  # the set named "default"
    ev("eval", 2, "eval", "hard", accuracy=0.125),
    ev("rollout", 4, "producer-a", reward_mean=1.0),
]
# (axis or axis/set, metric, step, value) of every point EVENTS hold
POINTS = sorted(
    (e.axis if e.axis != "eval" else f"eval/{e.eval_set or 'default'}", name, e.step, v)
    for e in EVENTS
    for name, v in e.values.items()
)


def drain(tracker: Tracker) -> None:
    while tracker.step(block=0.1):
        pass


# ---------------------------------------------------------------- reading the files back


def tb_points(directory: Path) -> list[tuple]:
    """(run, metric, step, value) of every scalar in the tracking dir's event files."""
    out = []
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        run = str(path.parent.relative_to(directory))
        for event in tb_loader.LegacyEventFileLoader(str(path)).Load():
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.append((run, v.tag.split("/", 1)[1], event.step, v.simple_value))
    return sorted(out)


def tb_tables(directory: Path) -> dict[int, list[list[str]]]:
    """Sample tables by version, as TensorBoard's own reader (EventAccumulator) sees them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(directory / "samples"), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        t.step: [[c.decode() for c in row] for row in tensor_util.make_ndarray(t.tensor_proto)]
        for t in acc.Tensors("samples/rollouts")
    }


def wandb_rows(directory: Path) -> list[dict]:
    """Every history row of every start of the run, from the `.wandb` transaction logs."""
    logs = [
        p for p in sorted(directory.glob("wandb/*/run-*.wandb")) if not p.parent.is_symlink()
    ]  # latest-run
    return [row for log in logs for row in tracking_wandb.history(log)]


def wandb_points(directory: Path) -> list[tuple]:
    out = []
    for row in wandb_rows(directory):
        for key, value in row.items():
            axis, _, name = key.partition("/")
            if key.startswith("_") or axis == "samples" or key in tracking_wandb.STEP_KEYS.values():
                continue
            if axis == "eval":
                eval_set, _, name = name.partition("/")
                axis = f"eval/{eval_set}"
            out.append((axis, name, row[tracking_wandb.STEP_KEYS[axis.split("/")[0]]], value))
    return sorted(out)


def points(backend: str, directory: Path) -> list[tuple]:
    return tb_points(directory) if backend == "tensorboard" else wandb_points(directory)


def approx_equal(got: list[tuple], want: list[tuple]) -> bool:
    """TensorBoard keeps float32 scalars."""
    return len(got) == len(want) and all(
        g[:3] == w[:3] and math.isclose(g[3], w[3], rel_tol=1e-6) for g, w in zip(got, want)
    )


# ---------------------------------------------------------------- the archive


def archive_record(n: int, version: int, rewards=(1.0, 0.0)) -> dict:
    """A group as the archiver writes it (consumers.archive.record), reduced to what tables read."""
    return {
        "id": f"{n}-0",
        "policy_version": version,
        "prompt": f"prompt {n}",
        "completions": [
            {"text": f"completion {n}.{i}", "reward": r, "version": version} for i, r in enumerate(rewards)
        ],
    }


def write_archive(cfg: RunConfig, records: list[dict], file_bytes: int = 1 << 20) -> RotatingWriter:
    writer = RotatingWriter(cfg.run_dir / "archive", file_bytes=file_bytes, max_bytes=1 << 30)
    writer.write([json.dumps(r) for r in records])
    return writer


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_event_is_written_once_on_its_own_axis_with_sample_tables(
    backend, client, keys, redis_url, tmp_path
):
    cfg = make_cfg(redis_url, keys.run, tmp_path / "data", backend, samples_every=2, samples_per_table=3)
    records = [archive_record(n, v) for n, v in enumerate([0, 0, 1, 2, 2, 2, 3, 4])]
    write_archive(cfg, records).close()
    pub = Publisher(client, keys, cfg.bus)
    pub.publish_many(keys.metrics, EVENTS[:4])
    tracker = Tracker(cfg)
    drain(tracker)
    pub.publish_many(keys.metrics, EVENTS[4:])
    pub.publish_many(keys.metrics, [EVENTS[-1]])  # a retried XADD's copy: the same event id
    drain(tracker)
    tracker.close()
    directory = cfg.tracking_dir
    got = points(backend, directory)
    assert approx_equal(got, POINTS), got
    # every entry acknowledged, and only once it was on disk: nothing left pending
    assert client.xpending(keys.metrics, "tracking")["pending"] == 0
    # tables of versions 0, 2, 4: the first 3 completions each sampled; version 4's was
    # still filling when the tracker stopped
    want = {
        0: [
            ["prompt 0", "completion 0.0", "1.0", "0"],
            ["prompt 0", "completion 0.1", "0.0", "0"],
            ["prompt 1", "completion 1.0", "1.0", "0"],
        ],
        2: [
            ["prompt 3", "completion 3.0", "1.0", "2"],
            ["prompt 3", "completion 3.1", "0.0", "2"],
            ["prompt 4", "completion 4.0", "1.0", "2"],
        ],
        4: [["prompt 7", "completion 7.0", "1.0", "4"], ["prompt 7", "completion 7.1", "0.0", "4"]],
    }
    if backend == "tensorboard":
        tables = tb_tables(directory)
        assert {v: rows[1:] for v, rows in tables.items()} == want
        assert tables[0][0] == ["prompt", "completion", "reward", "version"]
        runs = {str(p.parent.relative_to(directory)) for p in directory.rglob("events.out.tfevents.*")}
        assert runs == {"train", "rollout", "eval/default", "eval/hard", "samples"}
    else:
        check_wandb_run(directory, want)


def check_wandb_run(directory: Path, want_tables: dict) -> None:
    """Each axis's keys charted against its own step key; the tables are wandb.Tables."""
    (run_dir,) = directory.glob("wandb/offline-run-*")
    records = tracking_wandb.TransactionLog(next(run_dir.glob("run-*.wandb"))).records()
    from wandb.proto import wandb_internal_pb2 as pb

    metrics = [pb.Record.FromString(r).metric for r in records if pb.Record.FromString(r).HasField("metric")]
    steps = {m.glob_name: m.step_metric for m in metrics if m.glob_name}
    assert steps == {
        "train/*": "train/step",
        "rollout/*": "rollout/step",
        "eval/*": "eval/version",
        "samples/*": "samples/version",
    }
    tables = {}
    for row in wandb_rows(directory):
        if "samples/version" in row:
            data = json.loads((run_dir / "files" / row["samples/rollouts/path"]).read_text())
            assert data["columns"] == ["prompt", "completion", "reward", "version"]
            tables[row["samples/version"]] = [
                [str(c) if not isinstance(c, str) else c for c in r] for r in data["data"]
            ]
    assert tables == {
        v: [[p, c, str(float(r)), str(int(ver))] for p, c, r, ver in rows] for v, rows in want_tables.items()
    }


def test_a_tensorboard_write_that_was_never_committed_is_cut_back_on_the_next_start(tmp_path):
    from consumers.tracking_tb import TensorBoard

    tb = TensorBoard(tmp_path)
    tb.write("1-0", EVENTS[0])
    tb.commit()
    tb.write("2-0", EVENTS[3])
    tb.write("3-0", EVENTS[1])  # a run directory never committed at all
    for f in tb.files.values():  # on disk, as a kill after the write would leave it
        f.fh.flush()
    assert len(tb_points(tmp_path)) == 5
    again = TensorBoard(tmp_path)  # the next start
    assert again.written_through == "1-0"
    assert tb_points(tmp_path) == [("train", "loss", 1, 0.5), ("train", "version", 1, 1.0)]
    again.write("2-0", EVENTS[3])
    again.close()
    assert [p[1:3] for p in tb_points(tmp_path)] == [("loss", 1), ("loss", 2), ("version", 1), ("version", 2)]


def test_a_disk_error_starts_the_backend_over_from_its_last_commit(
    client, keys, redis_url, tmp_path, monkeypatch
):
    from consumers import tracker as tracker_module
    from consumers import tracking_tb

    cfg = make_cfg(redis_url, keys.run, tmp_path, "tensorboard", samples_every=0)
    pub = Publisher(client, keys, cfg.bus)
    pub.publish_many(keys.metrics, EVENTS[:1])
    tracker = Tracker(cfg)
    drain(tracker)
    pub.publish_many(keys.metrics, EVENTS[1:4])
    real = tracking_tb.replace_durably

    def full_once(path, data):
        monkeypatch.setattr(tracking_tb, "replace_durably", real)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracking_tb, "replace_durably", full_once)
    with pytest.raises(OSError):
        tracker.step(block=0.1)  # written, not committed, not acknowledged
    assert client.xpending(keys.metrics, "tracking")["pending"] == 3
    monkeypatch.setattr(tracker_module, "RETRY_SECONDS", 0.01)
    tracker._recover(OSError(28, "No space left on device"), threading.Event())
    pub.publish_many(keys.metrics, EVENTS[4:])
    drain(tracker)
    tracker.close()
    assert approx_equal(tb_points(cfg.tracking_dir), POINTS)
    assert client.xpending(keys.metrics, "tracking")["pending"] == 0


def test_the_archive_is_followed_through_appends_rotation_and_a_restarted_archiver(tmp_path):
    cfg = make_cfg("redis://unused", "r", tmp_path, "tensorboard")
    writer = write_archive(cfg, [archive_record(0, 0)], file_bytes=400)
    tail = ArchiveTail(cfg.run_dir / "archive")
    assert [r["id"] for r in tail.records()] == ["0-0"]
    writer.write([json.dumps(archive_record(n, 1)) for n in (1, 2, 3)])  # rotates past 400 bytes
    writer.close()
    again = RotatingWriter(cfg.run_dir / "archive", file_bytes=400, max_bytes=1 << 30)  # a new gzip member
    again.write([json.dumps(archive_record(4, 2))])
    again.close()
    assert [r["id"] for r in tail.records()] == ["1-0", "2-0", "3-0", "4-0"]
    assert len(list((cfg.run_dir / "archive").iterdir())) > 1
    # a restarted tracker that wrote version 0's table starts at the file holding version 1
    tables = SampleTables(cfg.run_dir / "archive", every=1, per_table=8, done_through=0)
    assert [v for v, _ in tables.read() + tables.flush()] == [1, 2]


def test_no_backend_or_a_missing_package_is_one_clear_error(tmp_path, redis_url, keys, monkeypatch):
    with pytest.raises(ConfigError, match="tracking.backend` is empty"):
        Tracker(make_cfg(redis_url, keys.run, tmp_path, ""))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'streamer-rl\[tracking\]'"):
        Tracker(make_cfg(redis_url, keys.run, tmp_path, "wandb"))
    config = write_toml(tmp_path / "t.toml", {"tracking": {"backend": "tensorboard"}})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; sys.modules['tensorboard'] = None; from streamer.cli import main; sys.exit(main())"
    args = ["track", "--config", str(config), "--redis-url", redis_url, "--run", keys.run]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--data-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        'streamer track: config error: tracking.backend = "tensorboard" needs the tensorboard package: '
        "pip install 'streamer-rl[tracking]'"
    )


# ---------------------------------------------------------------- killed, restarted


def start_tracker(config: Path, redis_url: str, run: str, data_dir: Path, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "streamer", "track", "--config", str(config), "--run", run]
    return subprocess.Popen(
        [*argv, "--redis-url", redis_url, "--data-dir", str(data_dir)],
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def many_events(first: int, n: int) -> list[MetricsEvent]:
    """``n`` events on the three axes, steps ``first``.. (every metric's point is unique)."""
    out = []
    for i in range(first, first + n):
        axis = ("train", "rollout", "eval")[i % 3]
        out.append(ev(axis, i, eval_set="hard" if i % 6 == 2 else "", loss=i / 7, tokens=float(i)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tracker_killed_mid_run_resumes_without_writing_a_point_twice(
    backend, client, keys, redis_url, tmp_path
):
    data = tmp_path / "data"
    cfg = make_cfg(redis_url, keys.run, data, backend, samples_every=0)
    tracking = msgspec.to_builtins(cfg.tracking)
    config = write_toml(tmp_path / "run.toml", {"tracking": tracking, "bus": {"block_seconds": 0.2}})
    pub = Publisher(client, keys, cfg.bus)
    events = many_events(1, 3000)
    pub.publish_many(keys.metrics, events)
    log = tmp_path / "track.log"
    first = start_tracker(config, redis_url, keys.run, data, log)
    directory = cfg.tracking_dir
    try:
        wait_until(
            lambda: len(points(backend, directory)) >= 100,
            timeout=START,
            what="the tracker to write its first points",
            watch=Watch(first, log=log),
        )
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        first.kill()
    written_before = len(points(backend, directory))
    assert written_before < 2 * len(events), "the tracker finished before it was killed: kill it sooner"
    more = many_events(len(events) + 1, 300)
    pub.publish_many(keys.metrics, more)
    want = sorted(p for e in events + more for p in one_points(e))
    second = start_tracker(config, redis_url, keys.run, data, log)
    try:
        wait_until(
            lambda: len(points(backend, directory)) >= len(want),
            timeout=START,
            what=f"the restarted tracker to write all {len(want)} points",
            watch=Watch(second, log=log),
        )
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        second.kill()
    got = points(backend, directory)
    twice = [p for p, n in collections.Counter(p[:3] for p in got).items() if n > 1]
    assert not twice, f"points written twice (axis, metric, step): {twice[:10]}"
    assert approx_equal(got, want)
    assert client.xpending(keys.metrics, "tracking")["pending"] == 0
    if backend == "wandb":  # W&B's own row counter goes on across the two starts
        steps = [row["_step"] for row in wandb_rows(directory)]
        assert steps == sorted(set(steps)), "wandb _step repeats across starts"


def one_points(e: MetricsEvent) -> list[tuple]:
    axis = e.axis if e.axis != "eval" else f"eval/{e.eval_set or 'default'}"
    return [(axis, name, e.step, v) for name, v in e.values.items()]


def test_the_exporters_trim_waits_for_the_tracker_within_its_max_lag(client, keys, redis_url, tmp_path):
    from consumers.exporter import Exporter

    cfg = make_cfg(redis_url, keys.run, tmp_path, "tensorboard", max_lag=3)
    pub = Publisher(client, keys, cfg.bus)
    pub.publish_many(keys.metrics, many_events(1, 5))
    tracker = Tracker(cfg)  # joins its group, reads nothing yet
    exporter = Exporter(cfg)
    try:
        exporter.bootstrap()
        exporter.consume(block=0.1)
        exporter.save_snapshot()
        pub.publish_many(keys.metrics, many_events(6, 5))
        exporter.consume(block=0.1)
        exporter.save_snapshot()  # would trim the first 5; the tracker has read none of them
        kept = client.xrange(keys.metrics)
        assert len(kept) == 3 + 5, "the trim should stop max_lag (3) entries before its cut"
        drain(tracker)
        pub.publish_many(keys.metrics, many_events(11, 1))
        exporter.consume(block=0.1)
        exporter.save_snapshot()  # the tracker has read everything: the trim goes to its own cut
        assert parse_id(client.xrange(keys.metrics)[0][0].decode()) > parse_id(kept[-1][0].decode())
    finally:
        tracker.close()
        exporter.close()


# ---------------------------------------------------------------- through `streamer up`


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_up_starts_the_tracker_and_stops_it_after_the_trainer(backend, tmp_path):
    cfg = replace(
        demo.config(),
        tracking={"backend": backend, "mode": "offline" if backend == "wandb" else "", "samples_every": 1},
        eval={"eval_every": 1},
    )
    config = write_toml(tmp_path / "run.toml", msgspec.to_builtins(cfg))
    data = tmp_path / "data"
    with Up(data, "--config", str(config), "--steps", "3", "--producers", "1") as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0, out
    assert "stopping (producers, evaluator, trainer, archiver, tracker, exporter, server)" in out, out
    directory = data / "demo" / "tracking"
    got = points(backend, directory)
    train = sorted({step for axis, name, step, _ in got if axis == "train" and name == "loss"})
    assert train == [1, 2, 3], got
    evals = [step for axis, name, step, _ in got if axis == "eval/default" and name == "accuracy"]
    assert 3 in evals and len(evals) == len(set(evals)), evals
    assert any(axis == "rollout" for axis, *_ in got)
    twice = [p for p, n in collections.Counter(p[:3] for p in got if p[0] != "rollout").items() if n > 1]
    assert not twice, twice
    if backend == "tensorboard":
        assert 0 in tb_tables(directory), "no sample table of version 0"
    else:
        assert any(row.get("samples/version") == 0 for row in wandb_rows(directory))
    log = (data / "demo" / "logs" / "track.log").read_text()
    assert "tracked" in log and "Traceback" not in log, log[-3000:]
