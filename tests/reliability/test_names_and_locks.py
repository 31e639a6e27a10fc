"""Run names that cannot escape the data dir, `--fresh` that deletes only what Streamer
marked, and one lock per data dir (embedded server) and per run (trainer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness import report
from trainer_data import REPO

from streamer.rundir import RUN_MARKER, mark_run, remove_marked, server_lock, trainer_lock

pytestmark = pytest.mark.slow


def streamer(cwd, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "streamer", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", ".hidden", "", "x\n"])
def test_run_names_that_are_not_plain_names_are_refused_before_anything_is_deleted(tmp_path, name):
    data = tmp_path / "data"
    (data / "valkey").mkdir(parents=True)
    keep = tmp_path / "precious.txt"
    keep.write_text("mine")
    (data / "valkey" / "appendonly.aof").write_text("x")
    res = streamer(tmp_path, "up", "--data-dir", str(data), "--run", name, "--fresh", "--no-progress")
    assert res.returncode == 2, res.stderr
    assert "config error" in res.stderr and "run name" in res.stderr, res.stderr
    assert keep.read_text() == "mine" and (data / "valkey" / "appendonly.aof").exists()


def test_fresh_refuses_a_directory_streamer_did_not_mark(tmp_path):
    data = tmp_path / "data"
    (data / "demo").mkdir(parents=True)
    (data / "demo" / "thesis.tex").write_text("years of work")
    res = streamer(tmp_path, "up", "--data-dir", str(data), "--fresh", "--no-progress")
    assert res.returncode == 2, res.stderr
    assert "did not create it; refusing to delete" in res.stderr, res.stderr
    assert (data / "demo" / "thesis.tex").read_text() == "years of work"
    report("fresh-unmarked", exit=res.returncode, kept=1)


def test_fresh_deletes_only_what_streamer_wrote_in_a_marked_run_dir(tmp_path):
    run = mark_run(tmp_path / "demo")
    for sub in ("weights/v00000001", "checkpoints/step-1", "logs", "archive"):
        (run / sub).mkdir(parents=True)
    (run / "curve.json").write_text("{}")
    (run / "archive" / "rollouts-000001.jsonl.gz").write_bytes(b"")
    (run / "notes.md").write_text("mine")
    from streamer.rundir import RUN_ENTRIES

    assert remove_marked(run, RUN_MARKER, RUN_ENTRIES)
    assert sorted(p.name for p in run.iterdir()) == ["notes.md"]
    (run / "notes.md").unlink()
    mark_run(run)
    assert remove_marked(run, RUN_MARKER, RUN_ENTRIES) and not run.exists()


def test_fresh_on_a_new_data_dir_starts_and_marks_it(tmp_path):
    from streamer.rundir import check_free

    run = tmp_path / "data" / "demo"
    check_free(trainer_lock(run))  # as `up --fresh` does first: must not create the run dir
    assert not run.exists()
    assert not remove_marked(run, RUN_MARKER)  # nothing to delete is not an error
    assert (mark_run(run) / RUN_MARKER).is_file()


def test_a_second_up_on_one_data_dir_gets_one_line(tmp_path):
    data = tmp_path / "data"
    with server_lock(data):  # as a running `up` holds it
        res = streamer(tmp_path, "up", "--data-dir", str(data), "--no-progress")
    assert res.returncode == 1, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and f"pid {os.getpid()}" in line and "in use" in line, res.stderr
    assert not (data / "valkey").exists()  # no second server was started on its files
    report("lock-data-dir", exit=res.returncode, message=repr(line))


def test_a_second_trainer_of_one_run_gets_one_line(tmp_path, redis_url):
    data = tmp_path / "data"
    with trainer_lock(data / "locked"):  # as a running trainer holds it
        res = streamer(
            tmp_path, "train", "--data-dir", str(data), "--run", "locked", "--redis-url", redis_url
        )
        up = streamer(
            tmp_path,
            "up",
            "--data-dir",
            str(data),
            "--run",
            "locked",
            "--redis-url",
            redis_url,
            "--no-progress",
        )
    for r in (res, up):
        assert r.returncode == 1, r.stderr
        assert f"run locked in {data} is in use by pid {os.getpid()}" in r.stderr, r.stderr
    report("lock-run", train_exit=res.returncode, up_exit=up.returncode)
