"""Group filters: every reason, the over-long modes, and user filters by import path."""

from __future__ import annotations

import random

import msgspec
import pytest
from trainer_data import make_group

from consumers.filters import GroupFilter, load_predicate
from streamer.config import TrainerSection
from streamer.errors import ConfigError

NOT_CALLABLE = 3


def only_even_rows(group) -> bool:
    return group.row % 2 == 0


def broken_filter(group) -> bool:
    raise RuntimeError("bug in the user's filter")


@pytest.fixture
def rng():
    return random.Random(7)


def test_staleness_window(rng):
    f = GroupFilter(max_staleness=2)
    assert f(make_group(rng, version=3), version=5).accepted
    assert f(make_group(rng, version=2), version=5).reason == "stale"
    assert GroupFilter(max_staleness=0)(make_group(rng, version=4), version=5).reason == "stale"
    assert GroupFilter(max_staleness=0)(make_group(rng, version=5), version=5).accepted


def test_zero_variance_and_too_few(rng):
    f = GroupFilter(max_staleness=0, min_group_size=3)
    assert f(make_group(rng, rewards=(1, 1, 1, 1)), version=0).reason == "zero_variance"
    assert f(make_group(rng, rewards=(0.5, 0.5, 0.5)), version=0).reason == "zero_variance"
    assert f(make_group(rng, rewards=(1, 0)), version=0).reason == "too_few_samples"
    aborted = make_group(rng, rewards=(1, 0, 1), finishes=["stop", "stop", "abort"])
    assert f(aborted, version=0).reason == "too_few_samples"
    assert f(make_group(rng, rewards=(1, 0, 0)), version=0).accepted


def test_overlong_drop(rng):
    g = make_group(rng, version=1, rewards=(1, 0, 0, 1), finishes=["stop", "length", "stop", "stop"])
    v = GroupFilter(max_staleness=0, min_group_size=2, overlong="drop")(g, version=1)
    assert v.accepted and len(v.group.samples) == 3
    assert all(s.finish_reason == "stop" for s in v.group.samples)
    # dropping leaves too few trainable samples
    g = make_group(rng, rewards=(1, 0, 0), finishes=["length", "length", "stop"])
    assert GroupFilter(max_staleness=0, min_group_size=2, overlong="drop")(g, version=0).reason == "overlong"
    # dropping the only other reward leaves a zero-variance group
    g = make_group(rng, rewards=(1, 0, 0), finishes=["length", "stop", "stop"])
    assert GroupFilter(max_staleness=0, overlong="drop")(g, version=0).reason == "zero_variance"


def test_overlong_mask_and_keep(rng):
    g = make_group(rng, rewards=(1, 0, 0, 1), finishes=["stop", "length", "stop", "stop"])
    masked = GroupFilter(max_staleness=0, overlong="mask")(g, version=0).group
    assert len(masked.samples) == 4
    assert masked.samples[1].loss_mask().sum() == 0  # kept for the group mean, not trained
    assert masked.samples[0].loss_mask().all()
    kept = GroupFilter(max_staleness=0, overlong="keep")(g, version=0).group
    assert kept is g


def test_policy_version_follows_dropped_samples(rng):
    g = make_group(rng, version=3, rewards=(1, 0, 1))
    old = make_group(rng, version=1, rewards=(0,), finishes=["length"]).samples[0]
    mixed = msgspec.structs.replace(g, samples=[*g.samples, old], policy_version=1)
    v = GroupFilter(max_staleness=5, overlong="drop")(mixed, version=3)
    assert v.accepted and v.group.policy_version == 3


def test_user_filter_by_import_path(rng):
    cfg = TrainerSection(user_filter="test_filters:only_even_rows", max_staleness=0)
    f = GroupFilter.from_config(cfg)
    assert f(make_group(rng, row=2), version=0).accepted
    assert f(make_group(rng, row=3), version=0).reason == "user_filter"
    assert load_predicate("test_filters.only_even_rows") is only_even_rows
    broken = GroupFilter(max_staleness=0, user_filter=broken_filter)
    assert broken(make_group(rng), version=0).reason == "user_filter"


@pytest.mark.parametrize(
    "path", ["nope_no_module:f", "test_filters:missing", "justaname", "test_filters:NOT_CALLABLE"]
)
def test_bad_user_filter_is_a_config_error(path):
    with pytest.raises(ConfigError, match="user_filter"):
        load_predicate(path)
