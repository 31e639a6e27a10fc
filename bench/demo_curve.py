"""Run the demo (`streamer up` with defaults) from scratch and print its learning curve.

    python bench/demo_curve.py              # one run, table of reward/eval per version
    python bench/demo_curve.py --runs 3     # repeat to show every run reaches the goal

Each run is `streamer up --fresh` in a temporary data directory; the numbers come from the
curve `up` records (rollout reward per sampling version, eval accuracy per version, time
until the moving reward and eval accuracy first reach 0.8). Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL_SECONDS = 300.0


def run_once(steps: int | None, producers: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        argv = [
            sys.executable,
            "-m",
            "streamer",
            "up",
            "--fresh",
            "--no-progress",
            "--data-dir",
            d,
            "--producers",
            str(producers),
        ]
        if steps:
            argv += ["--steps", str(steps)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"streamer up exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads((Path(d) / "demo" / "curve.json").read_text())


def bucket_table(curve: dict, width: int) -> list[str]:
    rewards = {int(v): r for v, r in curve["reward_by_version"].items() if int(v) >= 0}
    counts = {int(v): n for v, n in curve["groups_by_version"].items() if int(v) >= 0}
    evals = {int(v): a for v, a in curve["eval_accuracy_by_version"].items()}
    lines = [
        "| versions | rollout reward (mean over groups) | eval accuracy at the end |",
        "| --- | --- | --- |",
    ]
    top = max([*rewards, *evals, 0])
    for lo in range(0, top + 1, width):
        hi = lo + width - 1
        vs = [v for v in rewards if lo <= v <= hi]
        n = sum(counts[v] for v in vs)
        mean = sum(rewards[v] * counts[v] for v in vs) / n if n else float("nan")
        ev = [evals[v] for v in sorted(evals) if lo <= v <= hi]
        lines.append(
            f"| {lo}-{hi} | {mean:.2f} | {ev[-1]:.2f} |" if ev else f"| {lo}-{hi} | {mean:.2f} | - |"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--steps", type=int, help="trainer steps (default: the demo's)")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--bucket", type=int, default=50, help="versions per table row")
    args = p.parse_args()
    curves = [run_once(args.steps, args.producers) for _ in range(args.runs)]
    print(*bucket_table(curves[0], args.bucket), sep="\n")
    print("\n| run | wall time | moving reward >= 0.8 after | eval accuracy >= 0.8 after | final eval |")
    print("| --- | --- | --- | --- | --- |")
    met = 0
    for i, c in enumerate(curves, 1):
        reached = c["reached_seconds"]
        evals = c["eval_accuracy_by_version"]
        final = evals[max(evals, key=int)] if evals else float("nan")
        r, e = reached.get("reward"), reached.get("eval")
        ok = r is not None and e is not None and max(r, e) <= GOAL_SECONDS
        met += ok
        fmt = lambda x: "not reached" if x is None else f"{x:.0f}s"  # noqa: E731
        print(f"| {i} | {c['wall_seconds']:.0f}s | {fmt(r)} | {fmt(e)} | {final:.2f} |")
    print(f"\nruns meeting the goal (both >= 0.8 within {GOAL_SECONDS:.0f}s): {met}/{len(curves)}")
    return 0 if met == len(curves) else 1


if __name__ == "__main__":
    sys.exit(main())
