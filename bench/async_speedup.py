"""Async speedup: groups trained per second with trainer.max_staleness=2 vs 0.

The whole system, for real, except the inference server: one private Valkey, a real
`streamer train` process (the demo's tiny model and its real training step: proximal
forward, 2 PPO minibatches, AdamW, weights written and published after every step,
checkpoints), and real `streamer produce` processes with the remote sampler. The
inference server is the test double producers.fake_server with a fixed latency per
request, standing in for vLLM/SGLang; it answers each demo prompt with half right and
half wrong one-digit completions, so every group has reward variance and is trained.

With max_staleness=0 (synchronous, on-policy) producers may only sample for the current
version: the trainer waits for sampling, sampling waits for the trainer. With
max_staleness=2 producers sample up to two versions ahead while the trainer trains. The
gain is largest when sampling a step's groups takes about as long as a training step,
which the default latency is chosen for on a 2-core CPU box (the table prints both, so
pick ``--latency`` on other machines to make them comparable).

Rate per side: the groups of the steps after ``--warmup`` divided by the time between the
trainer's metrics events of those steps (so process start-up is not counted). Sides
alternate order between repeats; medians of the repeats are reported.

    python bench/async_speedup.py                 # 4 producers, 3 repeats (< 2 minutes)
    python bench/async_speedup.py --quick         # smoke run
    python bench/async_speedup.py --producers 8 --steps 40 --repeats 5 --latency 0.02

Long-tailed mode (``--long-tail``): each request's latency is drawn from a Pareto
distribution (shape ``--tail-alpha``, scale ``--latency``; capped at 50x), as real
generation lengths and tool calls are, and each producer keeps ``--concurrency`` rows in
flight. A synchronous step waits for the slowest of its groups; an asynchronous one does
not (goal: >= 2.5x; AReaL reports 2.77x)::

    python bench/async_speedup.py --long-tail --latency 0.1 --producers 2 --concurrency 12

Final line: ``ratios: async_vs_sync=...x`` (AReaL reports 2.77x at cluster scale).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from producers.fake_server import FakeCompletionsServer
from producers.samplers import Completion
from schemas import MetricsEvent
from streamer import demo
from streamer.bus import entry_event
from streamer.connection import connect
from streamer.keys import Keys

SIDES = {"sync": 0, "async": 2}  # side name -> trainer.max_staleness
COLUMNS = {  # table column -> what run_side measures
    "groups/s": "rate",
    "s/step": "step_s",
    "train s": "train_s",
    "sampling s": "sampling_s",
    "data wait s": "wait_s",
    "mean lag": "staleness",
    "rejected": "rejected",
}
AREAL = 2.77


def demo_backend(*, logprob: float = -2.3):
    """A fake-server backend for demo prompts: the first half of the G completions give the
    right digit, the rest a wrong one (each followed by EOS)."""
    tok = demo.tokenizer()
    digit = {d: tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    eos = tok.eos_token_id

    def backend(body: dict) -> list[Completion]:
        text = tok.decode(body["prompt"], skip_special_tokens=True)
        match = re.search(r"(\d)\+(\d)=", text)
        answer = int(match.group(1)) + int(match.group(2)) if match else 0
        n = int(body.get("n", 1))
        picks = [answer if i < (n + 1) // 2 else (answer + 1 + i % 9) % 10 for i in range(n)]
        return [Completion([digit[p], eos], [logprob, logprob], "stop") for p in picks]

    return backend


def long_tailed(backend, *, scale: float, alpha: float, seed: int = 0, cap: float = 50.0):
    """``backend`` after a Pareto(alpha)-distributed delay of at least ``scale`` seconds."""
    rng, lock = random.Random(seed), threading.Lock()

    def delayed(body: dict) -> list[Completion]:
        with lock:
            delay = scale * min(cap, rng.paretovariate(alpha))
        time.sleep(delay)
        return backend(body)

    return delayed


def write_config(workdir: Path, keys: Keys, *, url: str, sampler_url: str, staleness: int, args) -> Path:
    """The demo's run config with the remote sampler and ``staleness``."""
    trainer = {
        "groups_per_step": args.groups_per_step,
        "max_staleness": staleness,
        "steps": args.warmup + args.steps,
        "lr": 1e-3,
        "ppo_minibatches": 2,
        "overlong": "keep",
        "checkpoint_every": 20,
    }
    producer = C.remote_producer(
        sampler_url, group_size=args.group_size, concurrency=args.concurrency, reward="streamer.demo:reward"
    )
    return C.write_run_config(workdir, keys, url, trainer=trainer, producer=producer)


def cleanup(procs: list[subprocess.Popen], client, keys: Keys) -> None:
    C.stop_processes(procs)
    C.drop_run(client, keys)
    client.close()


def run_side(
    staleness: int, *, url: str, sampler_url: str, workdir: Path, args, cleanups: list[threading.Thread]
) -> dict:
    """One run of the whole system at ``staleness``; the trainer's metrics of its steps.

    Once the trainer is done, the producers are stopped and the run's keys deleted in a
    thread (appended to ``cleanups``), overlapping the next run's start-up, which is not
    measured."""
    keys, started = C.fresh_keys("async"), time.time()
    config = write_config(workdir, keys, url=url, sampler_url=sampler_url, staleness=staleness, args=args)
    log = workdir / f"{keys.run}.log"
    client = connect(url)
    procs = [C.spawn_role("train", config, log=log, threads=args.trainer_threads, log_level=args.log_level)]
    procs += [
        C.spawn_role("produce", config, "--id", f"p{i}", log=log, threads=1, log_level=args.log_level)
        for i in range(args.producers)
    ]
    try:
        try:
            procs[0].wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"trainer did not finish in {args.timeout:.0f} s; log {log}") from None
        if procs[0].returncode != 0:
            raise SystemExit(f"trainer exited {procs[0].returncode}:\n{log.read_text()[-3000:]}")
        events = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    finally:
        cleanups.append(threading.Thread(target=cleanup, args=(procs, client, keys)))
        cleanups[-1].start()
    train = [e for e in events if e.axis == "train"]
    sampled = [
        e.values["sample_seconds"] for e in events if e.axis == "rollout" and "sample_seconds" in e.values
    ]
    return {
        **summarize(train, warmup=args.warmup),
        "sampling_s": C.median(sampled) * args.groups_per_step / args.producers,
        "first_step": min(e.at for e in train) - started,
    }


def summarize(train: list[MetricsEvent], *, warmup: int) -> dict:
    """Groups trained per second over the steps after ``warmup``, and what the steps did."""
    train = sorted(train, key=lambda e: e.step)
    measured = train[warmup:]
    if len(measured) < 2:
        raise SystemExit(f"only {len(train)} train steps were published")
    groups = sum(e.values["groups_accepted"] for e in measured)
    span = measured[-1].at - train[warmup - 1].at
    pick = lambda name: C.median([e.values[name] for e in measured])  # noqa: E731
    return {
        "rate": groups / span,
        "step_s": span / len(measured),
        "train_s": pick("step_seconds"),
        "wait_s": pick("data_wait_seconds"),
        "staleness": sum(e.values["staleness_mean"] for e in measured) / len(measured),
        "rejected": sum(
            e.values.get(f"groups_rejected_{r}", 0.0) for e in measured for r in ("stale", "zero_variance")
        ),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    ap.set_defaults(repeats=3)
    ap.add_argument("--producers", type=int, default=4, help="producer processes")
    ap.add_argument("--latency", type=float, default=0.03, help="seconds per sampling request (one group)")
    ap.add_argument("--steps", type=int, default=12, help="measured trainer steps per run")
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="trainer steps not measured (>= max_staleness + 1: the backlog producers "
        "sample before the trainer is up is used up)",
    )
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument(
        "--trainer-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 2),
        help="torch threads of the trainer (default: half the cores, at least 1)",
    )
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds a run may take")
    ap.add_argument(
        "--log-level",
        default="WARNING",
        help="of the trainer and producers (their log "
        "goes to a file in the temporary directory, printed when a run fails)",
    )
    ap.add_argument("--concurrency", type=int, default=1, help="rows in flight per producer")
    ap.add_argument("--long-tail", action="store_true", help="Pareto-distributed request latency")
    ap.add_argument("--tail-alpha", type=float, default=1.5, help="Pareto shape of --long-tail")
    args = C.parse_args(
        ap, argv, quick="tiny sizes for a smoke test", repeats=1, steps=3, warmup=1, producers=2
    )
    if args.warmup < 1 or args.steps < 2:
        ap.error("--warmup must be >= 1 and --steps >= 2")
    return args


def backend_of(args) -> tuple:
    """(backend, latency=...) of the fake server: fixed latency, or long-tailed."""
    if args.long_tail:
        return long_tailed(demo_backend(), scale=args.latency, alpha=args.tail_alpha), 0.0
    return demo_backend(), args.latency


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    cleanups: list[threading.Thread] = []
    common = dict(args=args, cleanups=cleanups)
    backend, latency = backend_of(args)
    with (
        tempfile.TemporaryDirectory(prefix="streamer-async-") as tmp,
        C.server_url(args) as url,
        FakeCompletionsServer(backend, latency=latency) as sampler,
    ):
        for r in range(args.repeats):
            for side in C.alternate(list(SIDES), r):
                t0 = time.monotonic()
                res = run_side(SIDES[side], url=url, sampler_url=sampler.url, workdir=Path(tmp), **common)
                results[side].append(res)
                print(
                    f"  repeat {r + 1} {side:>5}: {res['rate']:.2f} groups/s (run "
                    f"{time.monotonic() - t0:.0f} s, first step {res['first_step']:.0f} s after start)",
                    flush=True,
                )
        for t in cleanups:
            t.join()
    sampling = args.groups_per_step / args.producers * args.latency
    tail = f"Pareto(alpha={args.tail_alpha}) x " if args.long_tail else ""
    print(
        f"demo model, {args.producers} producers x {args.concurrency} in flight, sampler latency "
        f"{tail}{args.latency * 1000:.0f} ms/group "
        f"(a step's {args.groups_per_step} groups x G={args.group_size}: ~{sampling:.2f} s of sampling), "
        f"{args.steps} steps after {args.warmup} warm-up, median of {args.repeats} repeats"
    )
    rows = [
        [side, staleness, *(C.median([r[k] for r in results[side]]) for k in COLUMNS.values())]
        for side, staleness in SIDES.items()
    ]
    C.print_table(["side", "max_staleness", *COLUMNS], rows)
    print(
        "s/step: wall time per step; train s: the trainer step (learner.train_step); sampling s: "
        "a step's groups / producers x the median time a producer's sample request took"
    )
    per_repeat = [a["rate"] / s["rate"] for a, s in zip(results["async"], results["sync"])]
    ratio = C.median([r["rate"] for r in results["async"]]) / C.median([r["rate"] for r in results["sync"]])
    print(
        f"per-repeat ratios {', '.join(f'{x:.2f}' for x in per_repeat)}; "
        f"bench took {time.monotonic() - began:.0f} s"
    )
    C.print_ratios({"async_vs_sync": ratio}, goals={"async_vs_sync": f"AReaL: {AREAL}x at cluster scale"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
