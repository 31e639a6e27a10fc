"""Server memory over a long run: flat once the exporter snapshots its state and trims.

A fast synthetic run against a private server: per train step one train event, G rollout
events (from 4 producers) and every 10th step an eval event, with the catalog's names and
realistic values, plus one policy version announced by the trainer's own script
(consumers.versions.ANNOUNCE). A real :class:`consumers.exporter.Exporter` runs its loop
in a thread (snapshot every ``--snapshot-interval`` seconds, then the metrics stream
trimmed behind it). At step ``--at`` and at the last step the writers pause, the exporter
catches up and takes two snapshots, and INFO ``used_memory`` is read: the ratio of the
two is the figure (goal: within 10 %). The exporter is then restarted from its snapshot
and its counters compared with the totals of every event ever written.

    python bench/metrics_memory.py                 # 2k vs 20k steps (~2-4 min here)
    python bench/metrics_memory.py --quick         # smoke run (200 vs 1000 steps)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from consumers.exporter import Exporter
from consumers.versions import ANNOUNCE, POLICY_KEEP
from schemas import MetricsEvent, WeightSync, encode
from streamer.bus import FIELD, entry
from streamer.config import RunConfig, replace

GOAL = 0.10
PRODUCERS = 4


def step_events(step: int, groups: int) -> list[MetricsEvent]:
    train = {
        "loss": 0.1,
        "tokens": 4096.0,
        "staleness_mean": 0.5,
        "staleness_max": 1.0,
        "reward_mean": 0.6,
        "step_seconds": 0.2,
        "version": float(step),
        "groups_accepted": float(groups),
    }
    out = [MetricsEvent(axis="train", step=step, values=train, source="trainer")]
    for g in range(groups):
        values = {"reward_mean": 0.5, "groups": 1.0, "tokens": 512.0, "policy_version": float(step - 1)}
        out.append(
            MetricsEvent(
                axis="rollout", step=step * groups + g, values=values, source=f"producer-p{g % PRODUCERS}"
            )
        )
    if step % 10 == 0:
        out.append(
            MetricsEvent(axis="eval", step=step, values={"accuracy": 0.7, "reward_mean": 0.7}, source="eval")
        )
    return out


def settle(ex: Exporter, written: int, timeout: float = 120.0) -> None:
    """Wait until the exporter applied ``written`` events and took two more snapshots."""
    deadline = time.monotonic() + timeout
    while sum(ex.state.events.values()) < written:
        if time.monotonic() > deadline:
            raise SystemExit(f"exporter applied {ex.state.events}, expected {written} events")
        time.sleep(0.05)
    target = ex.snapshots + 2
    while ex.snapshots < target:
        if time.monotonic() > deadline:
            raise SystemExit("exporter took no snapshot")
        time.sleep(0.05)


def run(args, url: str) -> dict:
    keys = C.fresh_keys("memory")
    cfg = replace(
        RunConfig(),
        run={"redis_url": url, "name": keys.run},
        metrics={"port": 0, "snapshot_interval": args.snapshot_interval, "health_interval": 3600.0},
        bus={"block_seconds": 0.2, "socket_timeout": 5.0},
    )
    client = C.bench_client(url)
    announce = client.register_script(ANNOUNCE)
    ex, stop = Exporter(cfg), threading.Event()
    ex.bootstrap()
    thread = threading.Thread(target=ex.run, args=(stop,), daemon=True)
    thread.start()
    written, points, max_len = 0, {}, 0
    totals: dict[str, float] = {"tokens": 0.0}
    for step in range(1, args.steps + 1):
        events = step_events(step, args.groups)
        pipe = client.pipeline(transaction=False)
        for e in events:
            pipe.xadd(keys.metrics, entry(e))
        sync = WeightSync(version=step, step=step, uri=f"file:///w/v{step:08d}", sha256="0" * 64)
        announce(keys=[keys.policy, keys.version], args=[FIELD, encode(sync), step, POLICY_KEEP], client=pipe)
        pipe.xlen(keys.metrics)
        max_len = max(max_len, pipe.execute()[-1])
        written += len(events)
        totals["tokens"] += 4096.0
        if step in (args.at, args.steps):
            settle(ex, written)
            info = client.info("memory")
            points[step] = {  # a row of the table, by column
                "used_memory MB": C.mb(int(info["used_memory"])),
                "metrics XLEN": int(client.xlen(keys.metrics)),
                "policy XLEN": int(client.xlen(keys.policy)),
                "snapshot bytes": int(client.strlen(keys.metrics_snapshot)),
                "events written": written,
            }
    stop.set()
    thread.join(10)
    ex.client.close()
    again = Exporter(cfg)  # a restart: from the snapshot and what follows it
    again.bootstrap()
    continuous = again.state.counters["streamer_train_tokens_total"] == totals["tokens"]
    events_ok = sum(again.state.events.values()) == written
    again.client.close()
    C.drop_run(client, keys)
    return {"points": points, "max_xlen": max_len, "restart_counters_equal": continuous and events_ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    ap.add_argument("--steps", type=int, default=20_000, help="train steps of the synthetic run")
    ap.add_argument("--at", type=int, default=2_000, help="the earlier measurement")
    ap.add_argument("--groups", type=int, default=8, help="rollout events (groups) per step")
    ap.add_argument("--snapshot-interval", type=float, default=2.0, help="exporter metrics.snapshot_interval")
    args = C.parse_args(ap, argv, quick="200 vs 1000 steps", steps=1000, at=200)
    began = time.monotonic()
    with C.server_url(args) as url:
        res = run(args, url)
    pts = res["points"]
    C.print_table(["step", *pts[args.at]], [[step, *p.values()] for step, p in sorted(pts.items())])
    ratio = pts[args.steps]["used_memory MB"] / pts[args.at]["used_memory MB"]
    print(f"largest metrics XLEN seen while writing: {res['max_xlen']}")
    print(
        f"exporter restarted from its snapshot: counters equal to the totals written: {res['restart_counters_equal']}"
    )
    name = f"used_memory_{args.steps}_vs_{args.at}_steps"
    met = abs(ratio - 1.0) <= GOAL
    C.print_ratios({name: ratio}, goals={name: f"goal within {GOAL:.0%} of 1: {'met' if met else 'NOT met'}"})
    print(f"bench took {time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0 if res["restart_counters_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
