"""bench/learning.py's pure parts: the config it runs and how it reads samples-to-target off a curve."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import learning

from streamer.config import parse_config


def test_the_config_is_the_demo_with_the_cell_set():
    cfg = parse_config(learning.config_toml(loss="cispo", staleness=2, seed=3, steps=40, eval_every=5))
    assert (cfg.trainer.loss, cfg.trainer.max_staleness, cfg.trainer.steps) == ("cispo", 2, 40)
    assert cfg.run.seed == 3 and cfg.eval.eval_every == 5
    assert cfg.producer.reward == "streamer.demo:reward" and cfg.trainer.lr == 1e-3  # the demo's


def test_samples_to_target():
    curve = {
        "groups_by_version": {"0": 10, "1": 12, "2": 8, "3": 5},
        "eval_accuracy_by_version": {"0": 0.1, "2": 0.85, "3": 0.9},
    }
    assert learning.samples_to_target(curve, 16) == {"reached": True, "version": 2, "samples": 22 * 16}
    curve["eval_accuracy_by_version"] = {"0": 0.1, "3": 0.5}
    assert learning.samples_to_target(curve, 2) == {"reached": False, "version": None, "samples": 35 * 2}
