"""Transport: the streamer bus vs the raw server limit, and vs a PipelineRL-style transport.

Realistic trajectory groups (G=8 samples x 512 and x 4096 tokens, a quarter prompt, a
float32 sampler log-prob per completion token) go through one private server, every side
in the same run, alternating order between repeats; medians of the repeats are reported,
ratios are medians of the per-repeat ratios. By default a side publishes everything, then
consumes it, in this process; --concurrent runs the two halves as two processes at once
(a running system; needs spare cores to mean anything).

1. vs raw (goal: streamer >= 0.90 of raw bytes/s)
   streamer  encode (schemas.encode) -> Publisher.publish_many (pipelined XADD) ->
             Consumer.read (XREADGROUP COUNT>1, decode + validate) -> tensor-ready arrays
             (np.concatenate of token ids and log-probs) -> Consumer.ack (XACK)
   raw       redis-py pipelined XADD / XREADGROUP / XACK of the same pre-encoded bytes,
             no codec, no arrays: the most this client and server move.
2. vs PipelineRL-style (goal: streamer >= 5x its groups/s), groups/s of:
   streamer          the path of 1, from the same groups
   ..., from lists   first building the groups from plain lists (Sample.build), as a
                     producer does with a sampler's output: the stricter comparison
   ..., 1 XADD/group Publisher.publish per group, no pipelining
   pipelinerl-style  pickle.dumps of the dict of lists, one XADD each (MAXLEN ~), XREAD
                     COUNT 1 from the last id (no groups, no acks), pickle.loads, np.asarray

    python bench/transport.py                 # defaults (< 1 minute on 2 cores)
    python bench/transport.py --mb 400 --pipelinerl-mb 100 --repeats 9 --concurrent  # big box
    python bench/transport.py --quick         # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle  # ONLY for the PipelineRL-style baseline we compare against; never elsewhere
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from schemas import Sample, TrajectoryGroup, encode
from streamer.bus import FIELD, Consumer, Publisher
from streamer.config import BusSection
from streamer.keys import TRAINER_GROUP

READ_TIMEOUT = 30.0  # a side that cannot read back what it wrote within this fails loudly
PER_GROUP = ["groups/s", "us/group", "client CPU", "server CPU"]  # the columns of both tables' sides
MODES = {False: "publish, then consume, in one process", True: "producer and consumer processes at once"}

# Each side is a publish half and a consume half, (client, keys) -> None, run one after the
# other in this process (default) or, with --concurrent, in two processes at once.


# ---------------------------------------------------------------- the streamer path


def streamer_publish(
    client,
    keys,
    groups: list[TrajectoryGroup],
    *,
    batch: int,
    pipelined: bool = True,
    from_lists: list[dict] | None = None,
) -> None:
    """Publish ``groups`` (built first from ``from_lists``, as a producer builds them from a
    sampler's lists, when given) with pipelined XADDs, or one XADD each."""
    pub = Publisher(client, keys, BusSection(max_unacked=10**9))
    if from_lists is not None:
        groups = [from_plain(d) for d in from_lists]
    for i in range(0, len(groups), batch):
        if pipelined:
            pub.publish_many(keys.traj, groups[i : i + batch])
        else:
            for g in groups[i : i + batch]:
                pub.publish(keys.traj, g)


def streamer_consume(client, keys, n: int, *, read_count: int) -> None:
    """Read ``n`` groups as the trainer does (decoded, validated), make arrays, ack."""
    cfg = BusSection(read_count=read_count)
    consumer = Consumer(client, keys, keys.traj, TRAINER_GROUP, "bench", as_type=TrajectoryGroup, cfg=cfg)
    got, deadline = 0, time.monotonic() + READ_TIMEOUT
    while got < n:
        deliveries = consumer.read(count=read_count, block=1.0)
        for d in deliveries:
            C.tensor_ready(d.event)
        consumer.ack([d.id for d in deliveries])
        got += len(deliveries)
        _check_deadline(deadline, got, n)


def from_plain(d: dict) -> TrajectoryGroup:
    """A producer's work: pack a sampler's lists into the wire form."""
    samples = [
        Sample.build(
            prompt_ids=s["input_ids"][: s["prompt_len"]],
            completion_ids=s["input_ids"][s["prompt_len"] :],
            logprobs=s["logprobs"],
            reward=s["reward"],
            finish_reason=s["finish_reason"],
            version=s["version"],
        )
        for s in d["samples"]
    ]
    return C.group(d["row"], samples)


# ---------------------------------------------------------------- the baselines


def raw_publish(client, keys, payloads: list[bytes], *, batch: int) -> None:
    """Pipelined XADD of pre-encoded bytes: no codec."""
    for i in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for p in payloads[i : i + batch]:
            pipe.xadd(keys.traj, {FIELD: p})
        pipe.execute()


def raw_consume(client, keys, n: int, *, read_count: int) -> None:
    """XREADGROUP COUNT>1 and XACK, the payload left as bytes."""
    got, deadline = 0, time.monotonic() + READ_TIMEOUT
    while got < n:
        resp = client.xreadgroup(TRAINER_GROUP, "raw", {keys.traj: ">"}, count=read_count, block=1000)
        entries = resp[0][1] if resp else []
        if entries:
            client.xack(keys.traj, TRAINER_GROUP, *(e[0] for e in entries))
        got += len(entries)
        _check_deadline(deadline, got, n)


def pipelinerl_publish(client, keys, plain: list[dict]) -> None:
    """The PipelineRL-style writer (the baseline; pickle lives only here): one
    ``XADD key MAXLEN ~ 1000000 * index <n> data <pickle>`` per group, no pipelining."""
    for i, d in enumerate(plain):
        fields = {"index": i, "data": pickle.dumps(d)}
        client.xadd(keys.traj, fields, maxlen=1_000_000, approximate=True)


def pipelinerl_consume(client, keys, n: int) -> None:
    """The PipelineRL-style reader: ``XREAD BLOCK 100 COUNT 1`` from the last id, no groups,
    no acks; unpickle and turn the lists into arrays."""
    got, last, deadline = 0, "0", time.monotonic() + READ_TIMEOUT
    while got < n:
        resp = client.xread({keys.traj: last}, count=1, block=100)
        for entry_id, fields in resp[0][1] if resp else []:
            last = entry_id
            C.plain_tensor_ready(pickle.loads(fields[b"data"]))  # the baseline's decode
            got += 1
        _check_deadline(deadline, got, n)


def _check_deadline(deadline: float, got: int, n: int) -> None:
    if time.monotonic() > deadline:
        raise SystemExit(f"read back only {got} of {n} entries within {READ_TIMEOUT:.0f}s")


# ---------------------------------------------------------------- running a side


def run_side(client, url: str, publish, consume, *, concurrent: bool) -> C.Stopwatch:
    """Time ``publish`` and ``consume`` on a fresh stream that has the trainer group."""
    keys = C.fresh_keys()
    client.xgroup_create(keys.traj, TRAINER_GROUP, id="0", mkstream=True)
    try:
        if not concurrent:
            watch = C.Stopwatch(client)
            watch.start()
            publish(client, keys)
            consume(client, keys)
            return watch.stop()
        return _run_split(client, url, keys, publish, consume)
    finally:
        C.drop_run(client, keys)


def _run_split(client, url: str, keys, publish, consume) -> C.Stopwatch:
    """Producer and consumer in two forked processes started together; client CPU is theirs."""
    ctx = multiprocessing.get_context("fork")
    barrier, cpu = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, url, keys, barrier, cpu)) for fn in (publish, consume)]
    for p in procs:
        p.start()
    watch = C.Stopwatch(client)
    watch.start()
    barrier.wait(timeout=30)
    for p in procs:
        p.join(READ_TIMEOUT + 30)
    watch.stop()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a side's process failed: exit codes {[p.exitcode for p in procs]}")
    watch.cpu = cpu.get(timeout=5) + cpu.get(timeout=5)
    return watch


def _child(fn, url: str, keys, barrier, cpu) -> None:
    client = C.bench_client(url)
    barrier.wait(timeout=30)
    c0 = time.process_time()
    fn(client, keys)
    cpu.put(time.process_time() - c0)
    client.close()


# ---------------------------------------------------------------- the two comparisons


def run_sides(sides: dict, repeats: int) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """Medians per side of wall, client CPU and server CPU seconds, and each repeat's wall
    times (for paired ratios); sides alternate their order between repeats."""
    runs: dict[str, list[C.Stopwatch]] = {k: [] for k in sides}
    per_repeat = []
    for r in range(repeats):
        this = {}
        for side in C.alternate(list(sides), r):
            runs[side].append(sides[side]())
            this[side] = runs[side][-1].wall
        per_repeat.append(this)
    med = {
        k: [C.median([getattr(w, f) for w in v]) for f in ("wall", "cpu", "server")] for k, v in runs.items()
    }
    return med, per_repeat


def paired(per_repeat: list[dict], slow: str, fast: str) -> float:
    """Median over repeats of wall(slow) / wall(fast): robust to a machine that drifts."""
    return C.median([r[slow] / r[fast] for r in per_repeat])


def vs_raw(client, url: str, args, tokens: int) -> tuple[list, float]:
    """Item 1 for one size: table rows and the streamer/raw bytes/s ratio."""
    probe = len(encode(C.make_groups(1, tokens=tokens, group_size=args.group_size)[0]))
    n = max(4, int(args.mb * 1e6 / probe))
    groups = C.make_groups(n, tokens=tokens, group_size=args.group_size)
    payloads = [encode(g) for g in groups]
    total = sum(map(len, payloads))
    b, rc = args.batch, args.read_count
    run = partial(run_side, client, url, concurrent=args.concurrent)
    sides = {
        "streamer": lambda: run(
            partial(streamer_publish, groups=groups, batch=b), partial(streamer_consume, n=n, read_count=rc)
        ),
        "raw": lambda: run(
            partial(raw_publish, payloads=payloads, batch=b), partial(raw_consume, n=n, read_count=rc)
        ),
    }
    med, per_repeat = run_sides(sides, args.repeats)
    rows = [
        [tokens, side, n, total / n / 1000, C.mb(total / med[side][0]), n / med[side][0]]
        + [t / n * 1e6 for t in med[side]]
        for side in sides
    ]
    return rows, paired(per_repeat, "raw", "streamer")


def vs_pipelinerl(client, url: str, args, tokens: int) -> tuple[list, dict[str, float]]:
    """Item 2 for one size: table rows and groups/s ratios against the PipelineRL style."""
    probe = len(encode(C.make_groups(1, tokens=tokens, group_size=args.group_size)[0]))
    n = max(4, int(args.pipelinerl_mb * 1e6 / probe))
    groups = C.make_groups(n, tokens=tokens, group_size=args.group_size, seed=1)
    plain = [C.as_plain_dict(g) for g in groups]
    b, run = args.batch, partial(run_side, client, url, concurrent=args.concurrent)
    consume = partial(streamer_consume, n=n, read_count=args.read_count)
    sides = {
        "streamer": lambda: run(partial(streamer_publish, groups=groups, batch=b), consume),
        "streamer, from lists": lambda: run(
            partial(streamer_publish, groups=[], from_lists=plain, batch=b), consume
        ),
        "streamer, 1 XADD/group": lambda: run(
            partial(streamer_publish, groups=groups, batch=b, pipelined=False), consume
        ),
        "pipelinerl-style": lambda: run(
            partial(pipelinerl_publish, plain=plain), partial(pipelinerl_consume, n=n)
        ),
    }
    med, per_repeat = run_sides(sides, args.repeats)
    wire = {side: probe for side in sides} | {"pipelinerl-style": len(pickle.dumps(plain[0]))}
    rows = [
        [tokens, side, n, wire[side] / 1000, n / med[side][0]] + [t / n * 1e6 for t in med[side]]
        for side in sides
    ]
    return rows, {side: paired(per_repeat, "pipelinerl-style", side) for side in list(sides)[:3]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    C.add_payload_args(ap, mb=60.0, mb_help="payload MB per repeat, vs-raw part")
    ap.add_argument(
        "--pipelinerl-mb",
        type=float,
        default=12.0,
        help="payload MB per repeat, vs-PipelineRL part (its lists are memory-hungry)",
    )
    ap.add_argument("--batch", type=int, default=16, help="groups per pipelined publish")
    ap.add_argument("--read-count", type=int, default=64, help="COUNT of each XREADGROUP")
    ap.add_argument("--only", choices=["raw", "pipelinerl"], help="run only one comparison")
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="publish and consume in two processes at once (a running system) "
        "instead of one after the other in this process",
    )
    return C.parse_args(ap, argv, quick="tiny sizes for a smoke test", mb=1.0, pipelinerl_mb=0.5, repeats=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began, ratios, goals = time.monotonic(), {}, {}
    with C.server_url(args) as url:
        client = C.bench_client(url)
        print(
            f"{C.server_version(client)}, G={args.group_size}, {args.repeats} repeats (medians; "
            f"ratios are medians of paired repeats), publish batch {args.batch}, "
            f"read COUNT {args.read_count}, {MODES[args.concurrent]}"
        )
        if args.only in (None, "raw"):
            rows = []
            for tokens in args.sizes:
                r, ratio = vs_raw(client, url, args, tokens)
                rows += r
                ratios[f"vs_raw_{tokens}"] = ratio
                goals[f"vs_raw_{tokens}"] = C.verdict(ratio, at_least=0.90)
            print("\n1. streamer vs raw pipelined XADD/XREADGROUP/XACK of the same bytes")
            C.print_table(["tokens", "side", "groups", "KB/group", "MB/s", *PER_GROUP], rows)
        if args.only in (None, "pipelinerl"):
            rows = []
            for tokens in args.sizes:
                r, rs = vs_pipelinerl(client, url, args, tokens)
                rows += r
                ratios[f"vs_pipelinerl_{tokens}"] = rs["streamer"]
                goals[f"vs_pipelinerl_{tokens}"] = C.verdict(rs["streamer"], at_least=5.0)
                ratios[f"from_lists_vs_pipelinerl_{tokens}"] = rs["streamer, from lists"]
                ratios[f"unpipelined_vs_pipelinerl_{tokens}"] = rs["streamer, 1 XADD/group"]
            print(
                "\n2. streamer vs PipelineRL-style (pickled dict of lists, 1 XADD/group, "
                "XREAD COUNT 1, lists -> arrays)"
            )
            C.print_table(["tokens", "side", "groups", "KB/group", *PER_GROUP], rows)
        client.close()
    print(
        f"took {time.monotonic() - began:.0f} s; CPU columns are us/group of this process and of the server"
    )
    C.print_ratios(ratios, goals=goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
