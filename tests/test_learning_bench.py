"""bench/learning.py's pure parts: the config it runs and how it reads samples-to-target off a curve."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import learning

from streamer import demo


def test_the_config_is_the_demo_with_the_cell_set():
    cfg = learning.config(loss="cispo", staleness=2, seed=3, steps=40, eval_every=5)
    assert (cfg.trainer.loss, cfg.trainer.max_staleness, cfg.trainer.steps) == ("cispo", 2, 40)
    assert cfg.run.seed == 3 and cfg.eval.eval_every == 5
    assert cfg.producer.reward == "streamer.demo:reward" and cfg.trainer.lr == demo.config().trainer.lr


def test_samples_to_target():
    curve = {
        "groups_by_version": {"0": 10, "1": 12, "2": 8, "3": 5},
        "eval_accuracy_by_version": {"0": 0.1, "2": 0.85, "3": 0.9},
    }
    assert learning.samples_to_target(curve, 16) == {"reached": True, "version": 2, "samples": 22 * 16}
    curve["eval_accuracy_by_version"] = {"0": 0.1, "3": 0.5}
    assert learning.samples_to_target(curve, 2) == {"reached": False, "version": None, "samples": 35 * 2}


def _runs(*counts):
    """Runs from counts; a negative count is a run that did not reach the target."""
    return [{"reached": c > 0, "samples": abs(c)} for c in counts]


def test_the_median_of_runs_some_of_which_never_reached_the_target():
    assert learning.median_bounds(_runs(30, 10, 20)) == (20, 20)
    assert learning.median_bounds(_runs(10, 20, -90)) == (20, 20)  # the unreached one is above
    assert learning.median_bounds(_runs(10, 80, -50)) == (50, 80)  # it may lie below 80
    assert learning.median_bounds(_runs(10, -50, -90)) == (50, math.inf)
    assert learning.ratio_verdict((100, 100), (105, 105)) == ("1.05x", "met")
    assert learning.ratio_verdict((100, 100), (50, 80)) == ("0.50–0.80x", "met")
    assert learning.ratio_verdict((100, 100), (200, math.inf)) == ("> 2.00x", "NOT met")
    assert learning.ratio_verdict((60, math.inf), (70, 90)) == ("0.00–1.50x", "undecided")
