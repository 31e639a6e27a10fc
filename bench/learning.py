"""Learning evidence: samples the demo needs to reach 0.8 eval accuracy, per loss and staleness.

    python bench/learning.py                                   # every loss x max_staleness 0, 2 x 3 seeds
    python bench/learning.py --losses grpo --seeds 0           # a reduced run (one loss, one seed)
    python bench/learning.py --losses grpo dapo --max-steps 300 --eval-every 5

Each cell is `streamer up --fresh` of the built-in demo (its trainer, producers, evaluator
and exporter as separate processes) with ``trainer.loss`` and ``trainer.max_staleness`` set,
in a temporary data directory, stopped (`--until-eval`) at the first evaluation at 0.8.
The evaluator scores the demo's held-out pairs, never trained on. The figure is **samples
to 0.8**: completions the producers sampled with policy versions older than the first
version whose greedy eval accuracy is >= 0.8 (``groups_by_version`` x ``group_size`` of
the curve `up` records), the median over seeds. A run that never gets there within
``--max-steps`` (or ``--timeout`` seconds) counts as at least the samples it drew (shown as
``>``), so a median can be exact, a range or a lower bound (:func:`median_bounds`). The
goal: max_staleness 2 (asynchronous) needs no more than 1.1x the samples of max_staleness 0
(synchronous), per loss; each loss is met, NOT met or undecided by the runs. Prints Markdown.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from streamer import demo
from streamer.config import replace
from streamer.config_trainer import LOSS_KEYS

TARGET = 0.8
GOAL = 1.1


def config(*, loss: str, staleness: int, seed: int, steps: int, eval_every: int):
    return replace(
        demo.config(),
        run={"seed": seed},
        trainer={"loss": loss, "max_staleness": staleness, "steps": steps},
        eval={"eval_every": eval_every},
    )


def run_cell(*, loss: str, staleness: int, seed: int, args) -> dict:
    """One `streamer up` run; its curve plus the samples it needed (None: never reached)."""
    cfg = config(loss=loss, staleness=staleness, seed=seed, steps=args.max_steps, eval_every=args.eval_every)
    with tempfile.TemporaryDirectory(prefix="streamer-learning-") as d:
        # stopped at the first eval at the target: what follows cannot change the figure, and
        # late in a run zero-variance filtering starves the trainer (tens of seconds a step)
        extra = ["--until-eval", str(TARGET), "--producers", str(args.producers)]
        curve = C.run_up(cfg, Path(d), *extra, timeout=args.timeout)
    return {**samples_to_target(curve, cfg.producer.group_size), "seconds": curve["wall"]}


def samples_to_target(curve: dict, group_size: int) -> dict:
    """Samples drawn with versions before the first with eval accuracy >= TARGET."""
    groups = {int(v): n for v, n in curve["groups_by_version"].items() if int(v) >= 0}
    evals = {int(v): a for v, a in curve["eval_accuracy_by_version"].items()}
    reached = next((v for v in sorted(evals) if evals[v] >= TARGET), None)
    limit = reached if reached is not None else max([*groups, 0]) + 1
    samples = sum(n for v, n in groups.items() if v < limit) * group_size
    return {"reached": reached is not None, "version": reached, "samples": samples}


def median_bounds(runs: list[dict]) -> tuple[float, float]:
    """Bounds on the median of samples to target when some runs never reached it (their
    count is only a lower bound): exact (lo == hi) when every run reached it, or when the
    middle run's count is below every unreached run's; otherwise [lo, hi], hi may be inf."""
    if all(r["reached"] for r in runs):
        med = statistics.median(r["samples"] for r in runs)
        return med, med
    k = (len(runs) + 1) // 2  # the middle run (the lower middle for an even count)
    lower = sorted(r["samples"] for r in runs)  # an unreached run's count bounds it from below
    reached = sorted(r["samples"] for r in runs if r["reached"])
    return lower[k - 1], (reached[k - 1] if len(reached) >= k else math.inf)


def cell_text(runs: list[dict]) -> str:
    lo, hi = median_bounds(runs)
    if lo == hi:
        return f"{lo:,.0f}"
    return f"> {lo:,.0f}" if hi == math.inf else f"{lo:,.0f}–{hi:,.0f}"


def ratio_verdict(sync: tuple[float, float], asyn: tuple[float, float]) -> tuple[str, str]:
    """async / sync as text, and whether the goal is met, not met or undecided by these runs."""
    lo, hi = asyn[0] / sync[1], (asyn[1] / sync[0] if sync[0] else math.inf)
    text = f"{lo:.2f}x" if lo == hi else (f"> {lo:.2f}x" if hi == math.inf else f"{lo:.2f}–{hi:.2f}x")
    verdict = "met" if hi <= GOAL else "NOT met" if lo > GOAL else "undecided"
    return text, verdict


def report(results: dict, args) -> None:
    print(
        f"samples to {TARGET} eval accuracy (median over seeds {args.seeds}; a run that did not "
        f"reach it counts as at least what it drew); demo, {args.producers} producer(s), "
        f"at most {args.max_steps} trainer steps, eval every {args.eval_every}"
    )
    print()
    print("| loss | max_staleness 0 | max_staleness 2 | async / sync | per seed (0; 2) | minutes |")
    print("| --- | --- | --- | --- | --- | --- |")
    verdicts = {}
    for loss in args.losses:
        sync, asyn = results.get((loss, 0), []), results.get((loss, 2), [])
        text = "—"
        if sync and asyn:
            text, verdict = ratio_verdict(median_bounds(sync), median_bounds(asyn))
            verdicts[loss] = f"{text.replace(' ', '')} ({verdict})"
        seeds = "; ".join(
            ", ".join(f"{r['samples']:,}" if r["reached"] else f">{r['samples']:,}" for r in runs)
            for runs in (sync, asyn)
        )
        cells = [cell_text(runs) if runs else "—" for runs in (sync, asyn)]
        minutes = sum(r["seconds"] for runs in (sync, asyn) for r in runs) / 60
        print(f"| `{loss}` | {cells[0]} | {cells[1]} | {text} | {seeds} | {minutes:.1f} |")
    print()
    goals = "  ".join(f"{k}={v}" for k, v in verdicts.items())
    print(f"ratios: {goals or 'none (one side only)'}  goal: async <= {GOAL}x sync")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--losses", nargs="+", choices=sorted(LOSS_KEYS), default=list(LOSS_KEYS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument(
        "--staleness", nargs="+", type=int, choices=(0, 2), default=[0, 2], help="one side only: no ratio"
    )
    ap.add_argument("--max-steps", type=int, default=demo.STEPS, help="trainer steps per run at most")
    ap.add_argument("--eval-every", type=int, default=5, help="evaluate every k-th version")
    ap.add_argument("--producers", type=int, default=2, help="producer processes per run")
    ap.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds one run may take; then it counts as it stands"
    )
    smoke = dict(losses=["grpo"], seeds=[0], max_steps=20)
    return C.parse_args(ap, argv, quick="one loss, one seed, 20 steps (smoke)", **smoke)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    for loss in args.losses:
        for staleness in args.staleness:
            for seed in args.seeds:
                r = run_cell(loss=loss, staleness=staleness, seed=seed, args=args)
                results.setdefault((loss, staleness), []).append(r)
                print(
                    f"  {loss} max_staleness={staleness} seed={seed}: "
                    f"{'reached at v' + str(r['version']) if r['reached'] else 'not reached'}, "
                    f"{r['samples']:,} samples, {r['seconds']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
