"""The example run configs in ops/examples/ load and validate, and the one-machine example
is the demo's config key for key (so `streamer up --config ops/examples/run.toml` is the demo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamer import demo
from streamer.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "ops" / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_every_example_config_loads(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.run.name


def test_the_one_machine_example_is_the_demo():
    assert load_config(EXAMPLES / "run.toml") == demo.config()


def test_the_two_machine_example_samples_through_vllm_and_writes_untied_versions():
    cfg = load_config(EXAMPLES / "two-machines.toml")
    assert cfg.producer.sampler == "remote" and cfg.producer.engine == "vllm" and cfg.untied_versions
    assert cfg.model.dtype == "bfloat16"
