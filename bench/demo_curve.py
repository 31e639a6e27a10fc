"""Run the demo (`streamer up` with its defaults) from scratch, per seed, and print its curve.

    python bench/demo_curve.py                      # seeds 0 1 2, 600 steps each (~6 min a seed here)
    python bench/demo_curve.py --seeds 0 --steps 300
    python bench/demo_curve.py --quick              # smoke run: one seed, 20 steps

Each run is `streamer up --fresh` of the built-in demo with ``run.seed`` set, in a temporary
data directory; the numbers come from the curve `up` records. Per seed: wall time, the steps
trained (fewer than asked when the producers found nothing left to teach and `up` ended the
run), when held-out accuracy (the evaluator's pairs, never trained on) and the moving
rollout reward first reached 0.8, the final held-out accuracy, and the groups the trainer
rejected per group it accepted over the run's last 100 steps (a zero-variance group of a
row that is already solved teaches nothing: sampling it is CPU spent on nothing).

Goals: held-out accuracy >= 0.8 within 300 s in every seed; rejected per accepted <= 3
over the last 100 steps. Prints Markdown, then a ``ratios:`` line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from streamer import demo
from streamer.cli.up import cores, default_producers
from streamer.config import replace

GOAL_SECONDS = 300.0
GOAL_REJECTED = 3.0
LAST = 100  # steps at the end of a run the rejected figure covers


def run_once(seed: int, steps: int, producers: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="streamer-demo-curve-") as d:
        cfg = replace(demo.config(), run={"seed": seed}, trainer={"steps": steps})
        curve = C.run_up(cfg, Path(d), *(["--producers", str(producers)] if producers else []), timeout=3600)
        said = (Path(d) / "up.log").read_text()
        curve["ended"] = "nothing left to teach" if "nothing left to teach" in said else "steps done"
        return curve


def rejected_per_accepted(curve: dict) -> float | None:
    """Mean over the run's last LAST steps of groups rejected per group accepted."""
    by_step = {int(s): r for s, r in curve.get("rejected_per_accepted_by_step", {}).items()}
    end = max(by_step, default=0)
    last = [r for s, r in by_step.items() if s > end - LAST]
    return sum(last) / len(last) if last else None


def every_100(evals: dict) -> str:
    """Held-out accuracy at versions 100, 200, ... (the last eval at or before each)."""
    by_version = sorted((int(v), a) for v, a in evals.items())
    out = []
    for at in range(100, (by_version[-1][0] if by_version else 0) + 1, 100):
        out.append(f"{[a for v, a in by_version if v <= at][-1]:.1f}")
    return " ".join(out) or "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=600, help="trainer steps asked for per run")
    p.add_argument("--producers", type=int, help="producer processes (default: up's, 1 on 2 cores)")
    p.add_argument("--quick", action="store_true", help="one seed, 20 steps")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.steps = args.seeds[:1], 20
    producers = args.producers or default_producers(cores())  # what `up` starts unless told
    print(f"demo, {producers} producer(s), {args.steps} steps asked for per seed")
    print(
        "\n| seed | wall time | steps | ended | held-out >= 0.8 after | reward >= 0.8 after "
        f"| final held-out | held-out at v100, v200, ... | rejected / accepted, last {LAST} steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    met, worst = 0, 0.0
    for seed in args.seeds:
        c = run_once(seed, args.steps, args.producers)
        evals = c["eval_accuracy_by_version"]
        final = evals[max(evals, key=int)] if evals else float("nan")
        r, e = c["reached_seconds"].get("reward"), c["reached_seconds"].get("eval")
        met += e is not None and e <= GOAL_SECONDS
        rej = rejected_per_accepted(c)
        worst = max(worst, rej or 0.0)
        fmt = lambda x: "not reached" if x is None else f"{x:.0f}s"  # noqa: E731
        rej_text = "-" if rej is None else f"{rej:.2f}"
        print(
            f"| {seed} | {c['wall_seconds']:.0f}s | {c['steps']} | {c['ended']} | {fmt(e)} | {fmt(r)} "
            f"| {final:.2f} | {every_100(evals)} | {rej_text} |"
        )
    n = len(args.seeds)
    print(f"\nseeds with held-out accuracy >= 0.8 within {GOAL_SECONDS:.0f}s: {met}/{n} (goal {n}/{n})")
    print(
        f"ratios: heldout_0.8_within_{GOAL_SECONDS:.0f}s={met}/{n} rejected_per_accepted_last{LAST}={worst:.2f} "
        f"(goal <= {GOAL_REJECTED:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
