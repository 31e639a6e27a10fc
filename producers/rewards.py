"""Reward functions: ``(row, completion_text, sample) -> float``, chosen by import path.

``row`` is the dataset row (a dict), ``completion_text`` the decoded completion with
special tokens dropped, ``sample`` the :class:`producers.samplers.Completion` (token ids,
log-probs, finish reason). A reward that raises, or returns something that is not a
finite number, marks that sample failed; the producer drops it from the group.

Shipped: :func:`exact_match`, :func:`math_answer` (GSM8K-style final-number grading) and
the demo task's ``streamer.demo:reward``. An empty ``producer.reward`` picks the
dataset's default (:func:`default_path`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from streamer import demo
from streamer.imports import load_function

RewardFn = Callable[..., float]

DEMO_REWARD = "streamer.demo:reward"
EXACT_MATCH = "producers.rewards:exact_match"


def default_path(configured: str, dataset: str) -> str:
    """The reward import path to use: the configured one, else the dataset's default."""
    if configured:
        return configured
    return DEMO_REWARD if dataset == demo.DEMO else EXACT_MATCH


def load(path: str) -> RewardFn:
    """Import ``"package.module:function"``; a ConfigError that says what is wrong."""
    return load_function(path, what="reward")


def score(fn: RewardFn, row: dict, text: str, sample) -> float:
    """``fn``'s reward as a finite float; raises (ValueError, TypeError, ...) otherwise."""
    value = float(fn(row, text, sample))
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value


def exact_match(row: dict, text: str, sample=None) -> float:
    """1.0 when the completion, stripped, equals ``row["answer"]`` (stripped), else 0.0."""
    return 1.0 if text.strip() == str(row["answer"]).strip() else 0.0


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY = re.compile(_NUMBER)


exact_match.required_fields = ("answer",)  # checked against every row before work starts


def final_number(text: str) -> float | None:
    """The answer a GSM8K-style text ends with: after ``####``, else ``\\boxed{}``, else the
    last number; ``$`` and thousands commas ignored. None when there is no number."""
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(text)
        if found:
            return _to_number(found[-1])
    found = _ANY.findall(text)
    return _to_number(found[-1]) if found else None


def _to_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def math_answer(row: dict, text: str, sample=None) -> float:
    """1.0 when the completion's final number equals the reference's (GSM8K ``answer``
    field, which ends in ``#### N``; a bare number works too), else 0.0."""
    reference = final_number(str(row["answer"]))
    if reference is None:
        raise ValueError(f"reference answer {row['answer']!r} has no number")
    got = final_number(text)
    return 1.0 if got is not None and math.isclose(got, reference, rel_tol=0, abs_tol=1e-6) else 0.0


math_answer.required_fields = ("answer",)
