"""Rewards: exact match, GSM8K-style final-number grading, loading by import path."""

from __future__ import annotations

import math

import pytest

from producers import rewards
from streamer.errors import ConfigError


def test_exact_match_strips_whitespace():
    assert rewards.exact_match({"answer": " 7"}, "7\n") == 1.0
    assert rewards.exact_match({"answer": 7}, "7") == 1.0
    assert rewards.exact_match({"answer": "7"}, "77") == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", 7.0),
        ("so the answer is \\boxed{1,234}", 1234.0),
        ("It costs $18. Then 2 more, so 20.", 20.0),
        ("#### -3.5 (and later 9)", -3.5),
        ("no number here", None),
    ],
)
def test_final_number(text, expected):
    assert rewards.final_number(text) == expected


def test_math_answer_grades_the_final_number():
    row = {"answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}
    assert rewards.math_answer(row, "48 + 24 = 72. #### 72") == 1.0
    assert rewards.math_answer(row, "The answer is 72.") == 1.0
    assert rewards.math_answer(row, "The answer is 71, not 72. #### 71") == 0.0
    assert rewards.math_answer(row, "I don't know") == 0.0
    assert rewards.math_answer({"answer": "1,000"}, "\\boxed{1000}") == 1.0
    with pytest.raises(ValueError, match="has no number"):
        rewards.math_answer({"answer": "none"}, "3")


def test_load_by_import_path_and_dataset_defaults():
    assert rewards.load("producers.rewards:math_answer") is rewards.math_answer
    assert rewards.load(rewards.default_path("", "demo"))({"answer": "3"}, "3", None) == 1.0
    assert rewards.default_path("", "data/train.jsonl") == "producers.rewards:exact_match"
    assert rewards.default_path("my.mod:fn", "demo") == "my.mod:fn"
    with pytest.raises(ConfigError, match='expected "module:function"'):
        rewards.load("producers.rewards.exact_match")
    with pytest.raises(ConfigError, match="cannot import"):
        rewards.load("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        rewards.load("producers.rewards:nope")


def test_score_refuses_what_is_not_a_finite_number():
    assert rewards.score(lambda r, t, s: 1, {}, "", None) == 1.0
    with pytest.raises(ValueError, match="not finite"):
        rewards.score(lambda r, t, s: math.nan, {}, "", None)
    with pytest.raises(TypeError):
        rewards.score(lambda r, t, s: None, {}, "", None)
