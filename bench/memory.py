"""Memory: server bytes per queued group, and a bounded stream under a producer flood.

1. Per queued group. For G=8 samples x 512 and x 4096 tokens, K groups are published
   (Publisher.publish_many) to a fresh stream that the trainer group exists on; reported
   per group: the INFO memory ``used_memory`` delta, the stream key's own ``MEMORY USAGE``,
   and both against the payload bytes (median of repeats).
2. Flood with a stalled trainer. P producer threads publish as fast as they can, each
   calling Publisher.wait_for_room() before every group, with ``bus.max_unacked = N``;
   the trainer group exists but reads nothing. XLEN is sampled throughout. Then the
   "trainer" acks a batch (and trims what every group acknowledged, as the trainer does)
   a few times: publishing must resume and block again, XLEN staying <= N + P - 1 (P
   producers may pass the check at the same moment).

    python bench/memory.py                       # defaults (< 1 minute)
    python bench/memory.py --limit 1024 --producers 8 --flood-tokens 4096   # bigger
    python bench/memory.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from schemas import TrajectoryGroup, encode
from streamer.bus import Consumer, Publisher, trim_acked
from streamer.config import BusSection
from streamer.keys import TRAINER_GROUP


def used_memory(client) -> int:
    """``used_memory`` once the server has finished freeing deleted keys in the background
    (valkey frees big keys lazily: a DEL just before would still be shrinking the figure)."""
    C.settle(client)
    return int(client.info("memory")["used_memory"])


# ---------------------------------------------------------------- 1. bytes per queued group


def per_group(client, groups: list[TrajectoryGroup], *, batch: int) -> tuple[float, float]:
    """(used_memory delta, MEMORY USAGE of the stream) per group once all are queued."""
    keys, cfg = C.fresh_keys(), BusSection()
    Consumer(client, keys, keys.traj, TRAINER_GROUP, "bench", as_type=TrajectoryGroup, cfg=cfg)
    pub = Publisher(client, keys, cfg)
    try:
        before = used_memory(client)
        for i in range(0, len(groups), batch):
            pub.publish_many(keys.traj, groups[i : i + batch])
        after = used_memory(client)
        usage = int(client.memory_usage(keys.traj, samples=0))
        return (after - before) / len(groups), usage / len(groups)
    finally:
        C.drop_run(client, keys)


def memory_table(client, args) -> tuple[list, dict[str, float]]:
    rows, ratios = [], {}
    for tokens in args.sizes:
        probe = len(encode(C.make_groups(1, tokens=tokens, group_size=args.group_size)[0]))
        n = max(4, int(args.mb * 1e6 / probe))
        groups = C.make_groups(n, tokens=tokens, group_size=args.group_size)
        payload = sum(len(encode(g)) for g in groups) / n
        runs = [per_group(client, groups, batch=16) for _ in range(args.repeats)]
        delta, usage = C.median([r[0] for r in runs]), C.median([r[1] for r in runs])
        rows.append([tokens, n, payload / 1000, delta / 1000, usage / 1000, delta - payload, delta / payload])
        ratios[f"used_memory_per_payload_{tokens}"] = delta / payload
    return rows, ratios


# ---------------------------------------------------------------- 2. flood, stalled trainer


class Flood:
    """P producer threads publishing one group after another, each after wait_for_room()."""

    def __init__(self, url: str, keys, cfg: BusSection, group: TrajectoryGroup, producers: int):
        self.stop = threading.Event()
        self.published = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(url, keys, cfg, group), daemon=True, name=f"flood-{i}")
            for i in range(producers)
        ]

    def _run(self, url: str, keys, cfg: BusSection, group: TrajectoryGroup) -> None:
        client = C.bench_client(url)
        pub = Publisher(client, keys, cfg)
        try:
            while not self.stop.is_set():
                pub.wait_for_room(self.stop.is_set)
                if self.stop.is_set():
                    break
                pub.publish(keys.traj, group)
                with self._lock:
                    self.published += 1
        except BaseException as e:  # reported by the main thread
            self.errors.append(e)
        finally:
            client.close()

    def __enter__(self) -> Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=10)


def watch(client, stream: str, flood: Flood, seconds: float, *, until=None) -> tuple[int, float | None]:
    """Sample XLEN for ``seconds`` (or until ``until()``); the max seen and when ``until`` held."""
    peak, start, hit = 0, time.monotonic(), None
    while (elapsed := time.monotonic() - start) < seconds:
        if flood.errors:
            raise SystemExit(f"producer failed: {flood.errors[0]!r}")
        peak = max(peak, int(client.xlen(stream)))
        if until is not None and hit is None and until():
            hit = elapsed
            break
        time.sleep(0.005)
    return peak, hit


def flood_run(url: str, client, args) -> tuple[list, dict]:
    """Stall, then ``cycles`` times: ack a batch, see publishing resume, see it block again."""
    keys = C.fresh_keys()
    limit, slack = args.limit, args.producers - 1
    cfg = BusSection(max_unacked=limit, backpressure_timeout=120.0, read_count=limit)
    group = C.make_groups(1, tokens=args.flood_tokens, group_size=args.group_size)[0]
    trainer = Consumer(client, keys, keys.traj, TRAINER_GROUP, "stalled", as_type=TrajectoryGroup, cfg=cfg)
    rows, peaks, resumes, base = [], [], [], used_memory(client)

    def blocked(phase: str, seconds: float, resumed: str) -> None:
        """Watch for ``seconds``, in two halves: the row of ``phase``, with what was published
        in the second half (nothing, once the stream is full)."""
        peak, _ = watch(client, keys.traj, flood, seconds / 2)
        n = flood.published
        peak2, _ = watch(client, keys.traj, flood, seconds / 2)
        peaks.extend([peak, peak2])
        memory = (used_memory(client) - base) / 1e6
        rows.append([phase, flood.published, max(peak, peak2), flood.published - n, resumed, memory])

    try:
        with Flood(url, keys, cfg, group, args.producers) as flood:
            blocked("stalled", 2 * args.stall, "-")
            for cycle in range(args.cycles):
                got = trainer.read(count=args.ack_batch, block=1.0)
                before = flood.published
                trainer.ack([d.id for d in got])
                trim_acked(client, keys.traj)  # the trainer trims what every group acknowledged
                _, resumed = watch(client, keys.traj, flood, 5.0, until=lambda b=before: flood.published > b)
                resumes.append(resumed)
                after = "never" if resumed is None else f"{resumed * 1000:.0f} ms"
                blocked(f"acked {len(got)} (cycle {cycle + 1})", args.stall, after)
    finally:
        C.drop_run(client, keys)
    ok_bound = max(peaks) <= limit + slack
    ok_resume = all(r is not None for r in resumes)
    return rows, {
        "max_xlen": max(peaks),
        "bound": limit + slack,
        "bounded": ok_bound,
        "resumed": ok_resume,
        "blocked": all(r[3] <= slack for r in rows),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    C.add_payload_args(ap, mb=30.0, mb_help="payload MB queued per repeat (part 1)")
    ap.add_argument("--limit", type=int, default=64, help="bus.max_unacked (N) for the flood")
    ap.add_argument("--producers", type=int, default=4, help="flooding producer threads (P)")
    ap.add_argument("--flood-tokens", type=int, default=512, help="tokens per sample in the flood")
    ap.add_argument("--stall", type=float, default=2.0, help="seconds the trainer stays stalled")
    ap.add_argument("--cycles", type=int, default=3, help="ack/resume cycles after the stall")
    ap.add_argument("--ack-batch", type=int, default=16, help="entries the trainer acks per cycle")
    smoke = dict(mb=0.5, repeats=1, stall=0.6, cycles=1, limit=16)
    return C.parse_args(ap, argv, quick="tiny sizes for a smoke test", **smoke)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    with C.server_url(args) as url:
        client = C.bench_client(url)
        print(f"{C.server_version(client)}, G={args.group_size}, {args.repeats} repeats (medians)")
        rows, ratios = memory_table(client, args)
        print("\n1. server memory per queued group")
        C.print_table(
            [
                "tokens",
                "groups",
                "payload KB",
                "used_memory KB",
                "MEMORY USAGE KB",
                "overhead B",
                "used/payload",
            ],
            rows,
        )
        rows, flood = flood_run(url, client, args)
        print(
            f"\n2. flood: {args.producers} producers, max_unacked={args.limit}, trainer stalled "
            f"(G={args.group_size} x {args.flood_tokens} tokens)"
        )
        C.print_table(
            ["phase", "published", "max XLEN", "published while blocked", "resumed after", "used_memory +MB"],
            rows,
        )
        client.close()
    ratios["max_xlen_vs_limit"] = flood["max_xlen"] / args.limit
    print(
        f"max XLEN {flood['max_xlen']} <= {flood['bound']} (N + P - 1): "
        f"{'yes' if flood['bounded'] else 'NO'}; blocked while stalled: "
        f"{'yes' if flood['blocked'] else 'NO'}; resumed after every ack: "
        f"{'yes' if flood['resumed'] else 'NO'}; "
        f"took {time.monotonic() - began:.0f} s"
    )
    C.print_ratios(ratios)
    return 0 if flood["bounded"] and flood["resumed"] and flood["blocked"] else 1


if __name__ == "__main__":
    sys.exit(main())
