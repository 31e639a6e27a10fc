"""`streamer up` end to end: real processes, the embedded server, the demo task."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from bounds import RUN, START

pytestmark = pytest.mark.slow

STEPS = 80


def _up(data_dir, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamer", "up", "--data-dir", str(data_dir), "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


class Scraper:
    """Reads `up`'s output and, once it names the /metrics URL, scrapes it until stopped."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.series = proc, [], set()
        self.stop = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(r"/metrics on (http://\S+/metrics)", line):
                threading.Thread(target=self._scrape, args=(m.group(1),), daemon=True).start()

    def _scrape(self, url: str) -> None:
        while not self.stop.is_set():
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
            except OSError:
                text = ""
            self.series |= {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and ln[0] != "#"}
            self.stop.wait(1.0)

    def output(self) -> str:
        return "".join(self.lines)


def test_up_runs_the_demo_learns_and_exits_0(tmp_path):
    proc = _up(tmp_path, "--steps", str(STEPS))
    scraper = Scraper(proc)
    try:
        code = proc.wait(timeout=RUN)
    finally:
        scraper.stop.set()
        proc.kill()
    scraper.reader.join(5)
    out = scraper.output()
    assert code == 0, out
    assert f"steps trained      {STEPS}" in out, out
    curve = json.loads((tmp_path / "demo" / "curve.json").read_text())
    rewards = {int(v): r for v, r in curve["reward_by_version"].items()}
    early = [r for v, r in rewards.items() if v < 10]
    late = [r for v, r in rewards.items() if v >= STEPS - 20]
    assert sum(late) / len(late) > sum(early) / len(early) + 0.05, rewards
    # the final version was scored on the held-out pairs; 80 steps are too few to expect those
    # above chance (0.1 at v80 on a quiet machine, at this and the previous commit): the
    # held-out figures are bench/demo_curve.py's and bench/learning.py's, over 400-500 steps
    assert str(STEPS) in curve["eval_accuracy_by_version"], curve["eval_accuracy_by_version"]
    for axis in ("train", "rollout", "eval"):
        assert f"streamer_{axis}_step" in scraper.series, sorted(scraper.series)
    assert "streamer_train_loss" in scraper.series and "streamer_eval_accuracy" in scraper.series
    weights = sorted((tmp_path / "demo" / "weights").iterdir())
    assert weights and weights[-1].name == f"v{STEPS:08d}"


def test_up_stops_in_order_on_sigterm_and_resumes(tmp_path):
    proc = _up(tmp_path, "--steps", "1000")
    scraper = Scraper(proc)
    ckpts = tmp_path / "demo" / "checkpoints"
    deadline = time.monotonic() + RUN
    while not (ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        assert proc.poll() is None, scraper.output()
        assert time.monotonic() < deadline, f"no checkpoint within {RUN:.0f} s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=START)  # each child has up.GRACE_SECONDS, then is killed
    scraper.stop.set()
    scraper.reader.join(5)
    assert code == 130, scraper.output()
    out = scraper.output()
    assert "stopping (producers, evaluator, trainer, archiver, exporter, server)" in out
    assert "did not stop within" not in out, out  # every child stopped within its grace period
    stopped_at = max(int(p.name.split("-")[1]) for p in ckpts.iterdir() if p.name.startswith("step-"))
    # the trainer's final checkpoint on SIGTERM: resume continues from it, not from zero
    again = _up(tmp_path, "--steps", str(stopped_at + 5))
    rescraper = Scraper(again)
    assert again.wait(timeout=RUN) == 0, rescraper.output()
    rescraper.stop.set()
    rescraper.reader.join(5)
    log = (tmp_path / "demo" / "logs" / "train.log").read_text()
    assert f"restored checkpoint step-{stopped_at:08d}" in log, log[-2000:]


def test_a_crashing_child_is_reported_and_up_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[producer]\ndataset = "/nonexistent/rows.jsonl"\n')
    proc = _up(tmp_path, "--config", str(bad), "--steps", "5")
    scraper = Scraper(proc)
    code = proc.wait(timeout=START)
    scraper.reader.join(5)
    out = scraper.output()
    assert code == 1, out
    assert re.search(r"produce-\d exited with code 2", out), out
    assert "/nonexistent/rows.jsonl" in out  # the last lines of its log say why
