"""Bounds on what one setting or one reply may cost: a judge's reply is read under
``reward.judge.max_reply_bytes``, an episode has at most ``producer.max_forks`` forks, a row's
samples and what a producer keeps in flight have upper limits (a config error naming the
key and the limit, exit 2), and a producer at the limit of rows in flight runs and stops cleanly.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from bounds import RUN, START
from harness import report, run_config_in
from producing import counters, make_producer, nothing_held, run_cfg
from trainer_data import REPO
from waits import wait_until

from producers.episodes import MAX_FORKS
from schemas import TrajectoryGroup, decode
from streamer.config import replace
from streamer.config_rollout import MAX_IN_FLIGHT, MAX_SAMPLES_PER_ROW
from streamer.rollout.contract import Episode, Segment, episodes

MiB = 1 << 20
CLOSED = "redis://127.0.0.1:1/0"  # config errors come before any connection


# ---------------------------------------------------------------- a judge's reply


class HugeJudge:
    """A judge on 127.0.0.1 whose every reply is ``total`` bytes of padding, chunked or with
    its Content-Length, sent as fast as the client takes it; counts what each request got
    written before the client hung up."""

    CHUNK = b" " * (64 << 10)

    def __init__(self, total: int, *, chunked: bool):
        self.total, self.chunked = total, chunked
        self.sent: list[int] = []  # bytes of body written, per finished request
        self.cond = threading.Condition()
        judge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                sent = 0
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if judge.chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                    else:
                        self.send_header("Content-Length", str(judge.total))
                    self.end_headers()
                    while sent < judge.total:
                        chunk = judge.CHUNK[: judge.total - sent]
                        if judge.chunked:
                            self.wfile.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                        else:
                            self.wfile.write(chunk)
                        sent += len(chunk)
                    if judge.chunked:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:  # the client hung up: what it should do with this reply
                    pass
                finally:
                    self.close_connection = True
                    with judge.cond:
                        judge.sent.append(sent)
                        judge.cond.notify_all()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_sent(self, requests: int, timeout: float) -> list[int]:
        """Bytes written per request once ``requests`` have ended (the client hung up)."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.sent) >= requests, timeout=timeout):
                raise AssertionError(
                    f"{requests - len(self.sent)} of {requests} replies still being sent after {timeout:.0f}s: "
                    "the judge's client reads on past reward.judge.max_reply_bytes"
                )
            return list(self.sent)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _peak_rss_mb() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def _reset_peak_rss() -> bool:
    """Start a new peak-RSS measurement of this process (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "declared"])
def test_a_judge_reply_larger_than_max_reply_bytes_drops_the_rollout_unread(
    keys, redis_url, tmp_path, client, caplog, chunked
):
    total = 256 * MiB  # per reply; G = 2 replies
    with HugeJudge(total, chunked=chunked) as judge:
        cfg = replace(
            run_cfg(keys, redis_url, tmp_path),
            producer={"reward": "judge"},
            reward={"judge": {"url": judge.url, "model": "judge-1", "retries": 0}},
        )
        cap = cfg.reward.judge.max_reply_bytes  # the default
        p = make_producer(cfg, client)
        measured = _reset_peak_rss()
        before = _peak_rss_mb()
        start = time.monotonic()
        outcome = p.step()
        elapsed = time.monotonic() - start
        peak = _peak_rss_mb()
        sent = judge.wait_sent(2, timeout=60)
    p.trips.flush_metrics()
    growth = round(peak - before, 1) if measured and before and peak else "?"
    report(
        f"judge-reply-cap-{'chunked' if chunked else 'declared'}",
        reply_mb=total // MiB,
        cap_mb=cap / MiB,
        sent_mb=[round(s / MiB, 1) for s in sent],
        seconds=round(elapsed, 2),
        peak_rss_growth_mb=growth,
        outcome=outcome,
    )
    assert outcome == "failed", "one rollout dropped; the producer goes on"
    assert counters(client, keys)["episodes_dropped_bad_reward"] == 2
    assert f"the judge's reply is larger than reward.judge.max_reply_bytes = {cap}" in caplog.text
    if not chunked:
        assert f"(Content-Length {total})" in caplog.text, "refused from the headers"
    assert max(sent) < total / 8, f"the server wrote {sent} of {total} bytes: the reply was read on"
    if isinstance(growth, float):
        assert growth < 64, f"peak RSS grew by {growth} MiB while two {total // MiB} MiB replies arrived"
    assert client.lrange(keys.requeue, 0, -1) == [b"0"], "the row is handed back"
    assert client.hget(keys.row_attempts, "0") == b"1", "the attempt counts (the judge's answer)"
    nothing_held(client, keys)


# ---------------------------------------------------------------- forks per episode


def test_an_episode_with_more_forks_than_max_forks_is_dropped_and_the_producer_goes_on(
    keys, redis_url, tmp_path, client, caplog
):
    def piece() -> list[Segment]:
        return [Segment([3, 8]), Segment([9], [-0.1], 0)]

    forks = {0: MAX_FORKS, 1: 0, 2: 600}  # at the cap, none, far past it

    @episodes
    async def forking(row, ctx, index):
        return Episode(piece(), float(index == 1), forks=[piece() for _ in range(forks[index])])

    cfg = run_cfg(keys, redis_url, tmp_path, group_size=3, min_group_size=2)
    assert cfg.producer.max_forks == MAX_FORKS, "the default"
    p = make_producer(cfg, client, rollout=forking)
    assert p.step() == "published"
    ((_, fields),) = client.xrange(keys.traj)
    group = decode(fields[b"d"], TrajectoryGroup)
    counted = counters(client, keys)
    report(
        "forks-per-episode",
        max_forks=MAX_FORKS,
        forks=list(forks.values()),
        samples_published=len(group.samples),
        dropped_too_many_forks=counted.get("episodes_dropped_too_many_forks", 0),
    )
    assert len(group.samples) == (MAX_FORKS + 1) + 1, "the episode at the cap and the one without forks"
    assert [s.episode for s in group.samples] == [0] * (MAX_FORKS + 1) + [None], "one piece: no number"
    assert counted["episodes_dropped_too_many_forks"] == 1
    assert "600 forks > producer.max_forks 64 (the episode would be 601 samples)" in caplog.text
    nothing_held(client, keys)


# ---------------------------------------------------------------- upper limits in config

HUGE_SET = '[eval.sets.big]\ndataset = "demo"\ntemperature = 1.0\n'
LIMITS = [  # (role, TOML, what its one stderr line says)
    (
        "eval",
        HUGE_SET + "k = 4\nsamples = 1000000000\n",
        f"`eval.sets.big.samples`: must be <= {MAX_SAMPLES_PER_ROW}",
    ),
    ("eval", HUGE_SET + "k = 100000\n", f"`eval.sets.big.k`: must be <= {MAX_SAMPLES_PER_ROW}"),
    (
        "produce",
        "[producer]\ngroup_size = 1000000000\n",
        f"`producer.group_size`: must be <= {MAX_SAMPLES_PER_ROW}",
    ),
    ("produce", "[producer]\nconcurrency = 100000\n", f"`producer.concurrency`: must be <= {MAX_IN_FLIGHT}"),
    ("up", "[producer]\nconcurrency = 100000\n", f"`producer.concurrency`: must be <= {MAX_IN_FLIGHT}"),
    (
        "produce",
        "[producer]\nremote_concurrency = 100000\n",
        f"`producer.remote_concurrency`: must be <= {MAX_IN_FLIGHT}",
    ),
    ("produce", "[reward]\nconcurrency = 100000\n", f"`reward.concurrency`: must be <= {MAX_IN_FLIGHT}"),
    ("produce", "[producer]\nmax_forks = 0\n", "`producer.max_forks`: must be >= 1"),
    ("produce", "[reward.judge]\nmax_reply_bytes = 0\n", "`reward.judge.max_reply_bytes`: must be >= 1"),
]


@pytest.mark.slow
def test_settings_past_their_upper_limit_are_one_line_naming_the_key_and_the_limit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    running = []
    for i, (role, text, expect) in enumerate(LIMITS):
        path = tmp_path / f"limit-{i}.toml"
        path.write_text(text)
        command = [sys.executable, "-m", "streamer", role, "--config", str(path)]
        command += ["--redis-url", CLOSED, "--data-dir", str(tmp_path)]
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        running.append((role, path, expect, proc))
    failures = []
    for role, path, expect, proc in running:
        _, err = proc.communicate(timeout=RUN)
        lines = err.strip().splitlines()
        prefix = f"streamer {role}: config error: {path}: key "
        if not (
            proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(prefix) and expect in lines[0]
        ):
            failures.append(f"{role} / {path.read_text()!r}: exit {proc.returncode}, stderr:\n{err[-1500:]}")
    report("upper-limits", cases=len(LIMITS), clear_exit_2=len(LIMITS) - len(failures), failed=len(failures))
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------- a producer at the limit


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


@pytest.mark.slow
def test_a_producer_with_the_most_rows_in_flight_runs_and_stops_cleanly(
    procs, redis_url, keys, tmp_path, client
):
    """Every row in flight waits for admission (no trainer: the window fills) polling the
    server from a thread of its own; all of them at once must fit the producer's connections."""
    config = run_config_in(tmp_path, keys, producer={"concurrency": MAX_IN_FLIGHT, "group_size": 2})
    start = time.monotonic()
    proc = procs.start("producer", "produce", "--config", str(config), "--redis-url", redis_url)
    wait_until(
        lambda: client.zcard(keys.leases) >= MAX_IN_FLIGHT,
        timeout=START,
        what=f"{MAX_IN_FLIGHT} rows in flight (a lease each)",
        watch=procs,
        interval=0.2,
    )
    in_flight_after = time.monotonic() - start
    threads, fds = _status(proc.pid, "Threads"), len(os.listdir(f"/proc/{proc.pid}/fd"))
    published = client.xlen(keys.traj)
    stop_start = time.monotonic()
    code = procs.stop("producer", timeout=60)
    stop_seconds = time.monotonic() - stop_start
    log = procs.log("producer")
    report(
        "producer-at-the-in-flight-limit",
        concurrency=MAX_IN_FLIGHT,
        in_flight_after_s=round(in_flight_after, 1),
        threads=threads,
        open_files=fds,
        published=published,
        stop_s=round(stop_seconds, 1),
        exit=code,
        too_many_connections=log.count("Too many connections"),
    )
    assert code == 0 and "Traceback" not in log and "Fatal Python error" not in log, log[-3000:]
    assert "Too many connections" not in log, "rows in flight ran out of server connections"
    assert fds < 1024, f"{fds} open files: past the usual soft limit"
    assert client.zcard(keys.leases) == 0, "every row in flight handed back at the stop"
