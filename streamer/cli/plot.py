"""`streamer plot`: one PNG of a run — did it learn, and how did the loop behave.

Four panels, each on its own step axis: rollout reward and eval accuracy against policy
version; every eval set's mean@k (solid) and pass@k (dashed) against policy version; loss
against train step; staleness (mean version lag of a step's groups) against train step. The data is the run's :class:`~streamer.readmodel.history.History`: the
exporter's snapshot plus the metrics stream after it (the stream itself is trimmed), or
`up`'s progress view, which holds the same fold, when `up` finishes.

matplotlib is an optional extra (``pip install 'streamer[plot]'``): it is for people
looking at a run, not for the processes that run it. Without it `streamer plot` says so
(exit 1) and `up` skips the picture with one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamer.config import RunConfig
from streamer.connection import connect, redact
from streamer.keys import Keys
from streamer.readmodel.history import History
from streamer.readmodel.saved import read_history


def draw(history: History, path: Path, *, title: str) -> Path:
    """Write the four panels to ``path`` (PNG); ImportError without matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(17, 3.8), layout="constrained")
    ax_v, ax_sets, ax_loss, ax_lag = fig.subplots(1, 4)
    reward, acc = history.reward_by_version.means(), history.eval_by_version.means()
    ax_v.plot(list(reward), list(reward.values()), ".-", ms=3, label="rollout reward (mean)")
    ax_v.plot(
        list(acc),
        list(acc.values()),
        "o-",
        ms=4,
        label=f"eval accuracy ({history.headline_set or 'held-out'})",
    )
    ax_v.set(xlabel="policy version", title="reward and accuracy")
    ax_v.legend(loc="lower right")
    _draw_sets(ax_sets, history)
    for ax, curve, name in (
        (ax_loss, history.loss_by_step, "loss"),
        (ax_lag, history.staleness_by_step, "staleness (versions)"),
    ):
        pts = curve.means()
        ax.plot(list(pts), list(pts.values()), "-", lw=1)
        ax.set(xlabel="train step", title=name)
    for ax in (ax_v, ax_sets, ax_loss, ax_lag):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def _draw_sets(ax, history: History) -> None:
    """Each eval set's mean@k (solid) and, past k = 1, its pass@k (dashed, same colour)."""
    for i, (name, curves) in enumerate(sorted(history.eval_sets.items())):
        colour = f"C{i % 10}"
        mean = curves.accuracy.means()
        ax.plot(list(mean), list(mean.values()), "o-", ms=3, color=colour, label=f"{name} mean@{curves.k}")
        if curves.k > 1:
            best = curves.pass_at_k.means()
            ax.plot(list(best), list(best.values()), "--", color=colour, label=f"{name} pass@{curves.k}")
    ax.set(xlabel="policy version", title="eval sets")
    if history.eval_sets:
        ax.legend(loc="lower right", fontsize="small")


def save_quietly(history: History, path: Path, *, title: str) -> Path | None:
    """`up`'s picture at the end: never fails the run (no matplotlib, no disk: one line)."""
    try:
        return draw(history, path, title=title)
    except ImportError:
        print("streamer up: no picture of the run (pip install 'streamer[plot]' for matplotlib)")
    except (OSError, ValueError) as e:
        print(f"streamer up: could not draw the run's picture: {e}")
    return None


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    keys = Keys(cfg.run.name)
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout)
    history = read_history(client, keys)
    if history is None:
        print(
            f"streamer plot: no metrics for run {cfg.run.name!r} on {redact(cfg.run.redis_url)}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else cfg.run_dir / "run.png"
    try:
        draw(history, out, title=f"run {cfg.run.name}: {history.train_step} steps, {history.groups} groups")
    except ImportError:
        print("streamer plot: needs matplotlib (pip install 'streamer[plot]')", file=sys.stderr)
        return 1
    print(out)
    return 0
