"""Producer throughput vs number of producer processes, when sampling dominates.

Each producer is a real `streamer produce` process (remote sampler, demo task) against one
Redis-protocol server; the inference server is a test double with a fixed latency per
request (producers.fake_server), standing in for vLLM/SGLang. Admission and backpressure
are opened wide so only sampling limits throughput. For each N the producers start with
admission shut, so start-up is not measured: once all N hold a row, admission opens, and
after a warm-up the published groups are counted over a fixed window.

    python bench/producer_scaling.py            # 1, 2, 4 producers  (< 1 minute)
    python bench/producer_scaling.py --with-8   # and 8
    python bench/producer_scaling.py --check    # exit 1 when 4 vs 1 is under 3.5x
    python bench/producer_scaling.py --inflight 16   # 1 producer, 16 rows in flight, vs 16 producers

Prints groups/s per N and the ratio of 4 producers to 1 (goal: >= 3.5x). With
``--inflight K``: one producer process with ``producer.concurrency = K`` against K
single-flight processes (goal: >= 0.9 of their groups/s).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from producers.fake_server import FakeCompletionsServer, canned
from streamer.admission import Admission
from streamer.connection import connect

GOAL = 3.5
INFLIGHT_GOAL = 0.9


def measure(n: int, where: tuple[str, str, Path], args, *, concurrency: int = 1) -> float:
    """Groups per second published by ``n`` producer processes, ``concurrency`` rows each;
    ``where``: the server's URL, the fake sampler's and a working directory."""
    redis_url, sampler_url, workdir = where
    keys = C.fresh_keys()
    client = connect(redis_url)
    gate = Admission(client, keys, max_staleness=0, groups_per_step=1)
    gate.publish_limits(max_staleness=0, groups_per_step=0)  # shut until every producer is up
    producer = C.remote_producer(
        sampler_url, group_size=args.group_size, concurrency=concurrency, min_group_size=1
    )
    wide_open = {"trainer": {"groups_per_step": C.WIDE_OPEN}, "bus": {"max_unacked": C.WIDE_OPEN}}
    config = C.write_run_config(workdir, keys, redis_url, **wide_open, producer=producer)
    procs = [C.spawn_role("produce", config, "--id", f"p{i}") for i in range(n)]
    try:
        deadline = time.monotonic() + 90
        while client.hlen(keys.lease_owner) < n * concurrency:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"{n} producers did not start")
            time.sleep(0.1)
        gate.publish_limits(max_staleness=0, groups_per_step=C.WIDE_OPEN)
        time.sleep(args.warmup)
        start, t0 = client.xlen(keys.traj), time.monotonic()
        time.sleep(args.window)
        end, t1 = client.xlen(keys.traj), time.monotonic()
        return (end - start) / (t1 - t0)
    finally:
        C.stop_processes(procs)
        C.drop_run(client, keys)
        client.close()


@contextlib.contextmanager
def servers(args):
    """A fake sampler with fixed latency and a server (``--redis-url`` or a private one):
    where :func:`measure` runs."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        FakeCompletionsServer(canned([10, 5]), latency=args.latency) as sampler,
        C.server_url(args) as url,
    ):
        yield url, sampler.url, Path(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=float, default=0.2, help="seconds per sampling request")
    ap.add_argument("--window", type=float, default=6.0, help="seconds of counting per N")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds after admission opens")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--with-8", action="store_true", help="also run 8 producers")
    ap.add_argument("--redis-url", help="use this server instead of an embedded one")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when 4 vs 1 < {GOAL}x")
    ap.add_argument("--inflight", type=int, default=0, help="K: 1 producer with K in flight vs K producers")
    args = ap.parse_args()
    if args.inflight:
        return inflight(args)
    counts = [1, 2, 4, 8] if args.with_8 else [1, 2, 4]
    began = time.monotonic()
    with servers(args) as where:
        print(
            f"fixed sampler latency {args.latency * 1000:.0f} ms, G={args.group_size}, "
            f"window {args.window:.0f} s per N"
        )
        print(f"{'producers':>9}  {'groups/s':>9}  {'vs 1':>6}  {'ideal':>6}")
        rates = {}
        for n in counts:
            rates[n] = measure(n, where, args)
            print(f"{n:>9}  {rates[n]:>9.2f}  {rates[n] / rates[1]:>5.2f}x  {n:>5}x", flush=True)
    ratio = rates[4] / rates[1]
    verdict = "meets" if ratio >= GOAL else "MISSES"
    print(
        f"4 producers vs 1: {ratio:.2f}x ({verdict} the goal of >= {GOAL}x); "
        f"bench took {time.monotonic() - began:.0f} s"
    )
    return 1 if args.check and ratio < GOAL else 0


def inflight(args) -> int:
    """One producer with ``args.inflight`` rows in flight vs that many single-flight producers."""
    k, began = args.inflight, time.monotonic()
    with servers(args) as where:
        print(f"fixed sampler latency {args.latency * 1000:.0f} ms, G={args.group_size}, {k} in flight")
        many = measure(k, where, args)
        print(f"{k} producer processes, 1 row each: {many:.2f} groups/s", flush=True)
        one = measure(1, where, args, concurrency=k)
        print(f"1 producer process, {k} rows in flight: {one:.2f} groups/s", flush=True)
    ratio = one / many
    verdict = "meets" if ratio >= INFLIGHT_GOAL else "MISSES"
    print(
        f"ratios: one_process_inflight_vs_processes={ratio:.2f} ({verdict} the goal of >= "
        f"{INFLIGHT_GOAL}); bench took {time.monotonic() - began:.0f} s"
    )
    return 1 if args.check and ratio < INFLIGHT_GOAL else 0


if __name__ == "__main__":
    sys.exit(main())
