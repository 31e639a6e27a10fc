"""Reward functions: ``(row, completion_text, sample) -> float``, chosen by import path.

``row`` is the dataset row (a dict), ``completion_text`` the decoded completion with
special tokens dropped, ``sample`` the :class:`producers.samplers.Completion` (token ids,
log-probs, finish reason). A reward that raises, or returns something that is not a
finite number, marks that sample failed; the producer drops it from the group.

A reward may be ``async def`` (a reward model or an LLM judge behind HTTP, such as the
built-in :mod:`producers.judge`): the default rollout then awaits a group's rewards
concurrently, at most ``reward.concurrency`` calls at once per producer, each within
``reward.timeout`` seconds. Two errors are not the sample's failure: a
:class:`~streamer.errors.SamplerError` (such as :class:`RewardUnavailable`, which a call
past its timeout raises) is an outage, and the row is handed back without counting an
attempt; an :class:`~streamer.errors.EpisodeRejected` drops the whole rollout with its
reason and counts one. A reward that holds a resource of the event loop (the judge's HTTP
client) has an ``async aclose()``; the loop's owner calls it through :func:`close`.

A reward may also have a ``score_group(row, texts, samples) -> list[float]`` method or
attribute (``async`` or not): a group's completions are then scored by one call of it (one
``reward.concurrency`` token, one ``reward.timeout``) rather than one call each, as the
judge's ``kind = "batch"`` does. It must still answer for one sample (a custom rollout may
ask it so; the evaluator asks a reward that is not ``async`` per completion).

Shipped: :func:`exact_match`, :func:`math_answer` (GSM8K-style final-number grading) and
the demo task's ``streamer.demo:reward``; by name rather than import path, ``"judge"``
(:mod:`producers.judge`), ``"math"`` and ``"reasoning_gym"`` (:mod:`producers.envs`). An
empty ``producer.reward`` picks the dataset's default (:func:`default_path`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re

import anyio

from producers import envs
from streamer import demo
from streamer.errors import EpisodeRejected, RewardUnavailable, SamplerError
from streamer.imports import load_function
from streamer.rollout.contract import RewardFn

log = logging.getLogger(__name__)


DEMO_REWARD = "streamer.demo:reward"
EXACT_MATCH = "producers.rewards:exact_match"


def default_path(configured: str, dataset: str) -> str:
    """The reward import path to use: the configured one, else the dataset's default."""
    if configured:
        return configured
    if dataset.startswith(envs.GYM_PREFIX):  # the task's own score_answer
        return "reasoning_gym"
    return DEMO_REWARD if dataset == demo.DEMO else EXACT_MATCH


def load(path: str) -> RewardFn:
    """Import ``"package.module:function"``; a ConfigError that says what is wrong."""
    return load_function(path, what="reward")


def score(fn: RewardFn, row: dict, text: str, sample) -> float:
    """``fn``'s reward as a finite float; raises (ValueError, TypeError, ...) otherwise."""
    value = fn(row, text, sample)
    if inspect.isawaitable(value):
        value.close()
        raise TypeError(f"reward {_name(fn)} is async: await it with score_async")
    return _finite(value)


def is_async(fn) -> bool:
    """Whether ``fn`` (a function or a callable object) is ``async def``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def score_async(
    fn: RewardFn, row: dict, text: str, sample, *, limiter=None, timeout: float = 0.0
) -> float:
    """``fn``'s reward as a finite float, awaited if ``fn`` is async: holding one of
    ``limiter``'s tokens (None: no bound), within ``timeout`` seconds (0: none; past it,
    :class:`RewardUnavailable`)."""
    if not is_async(fn):
        return score(fn, row, text, sample)
    return _finite(await _bounded(fn, row, text, sample, name=_name(fn), limiter=limiter, timeout=timeout))


async def _bounded(call, *args, name: str, limiter=None, timeout: float = 0.0):
    """``call(*args)``, awaited if it gives an awaitable, holding one of ``limiter``'s tokens,
    within ``timeout`` seconds (0: none; past it, :class:`RewardUnavailable`)."""
    async with limiter if limiter is not None else contextlib.nullcontext():
        with anyio.move_on_after(timeout or None) as scope:
            value = call(*args)
            if inspect.isawaitable(value):
                value = await value
    if scope.cancelled_caught:
        raise RewardUnavailable(f"reward {name} gave no answer within {timeout:g}s")
    return value


async def score_all(
    fn: RewardFn, row: dict, texts: list[str], samples, *, name: str = "", **bounds
) -> list[float | None]:
    """The reward of each (text, sample); None where the reward failed (logged, as ``name``).
    An async ``fn`` is awaited for all of them at once (``bounds``: :func:`score_async`'s)."""
    group = getattr(fn, "score_group", None)
    if group is not None and texts:
        return await _score_group(fn, group, row, texts, samples, name=name, **bounds)
    out: list[float | None] = [None] * len(texts)
    sync = not is_async(fn)  # asked once: inspect's answer costs more than a small reward

    async def one(i: int) -> None:
        try:
            if sync:
                out[i] = score(fn, row, texts[i], samples[i])
            else:
                out[i] = await score_async(fn, row, texts[i], samples[i], **bounds)
        except (SamplerError, EpisodeRejected):
            raise  # an outage, or the whole rollout's rejection: not this sample's failure
        except Exception as e:  # a user function: anything it raises marks the sample failed
            log.warning("reward %s raised %s: %s (sample dropped)", name or _name(fn), type(e).__name__, e)

    if sync:
        for i in range(len(texts)):
            await one(i)
        return out
    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    return out


async def _score_group(
    fn, group, row: dict, texts: list[str], samples, *, name: str, limiter=None, timeout: float = 0.0
) -> list[float | None]:
    """A group reward's scores: ``group`` awaited once for all of ``texts``, holding one of
    ``limiter``'s tokens, within ``timeout`` seconds. As for one sample's reward, what it
    raises (other than an outage or a rejection) marks every sample failed, and a value that
    is not a finite number marks its own sample failed."""
    name = name or _name(fn)
    try:
        values = await _bounded(group, row, texts, samples, name=name, limiter=limiter, timeout=timeout)
        if not isinstance(values, (list, tuple)) or len(values) != len(texts):
            raise TypeError(f"score_group gave {values!r:.200}, not a list of {len(texts)} scores")
    except (SamplerError, EpisodeRejected):
        raise
    except Exception as e:  # a user function: anything it raises marks the samples failed
        log.warning("reward %s raised %s: %s (%d samples dropped)", name, type(e).__name__, e, len(texts))
        return [None] * len(texts)
    out: list[float | None] = []
    for value in values:
        try:
            out.append(_finite(value))
        except (TypeError, ValueError) as e:
            log.warning("reward %s: %s (sample dropped)", name, e)
            out.append(None)
    return out


async def close(fn: RewardFn) -> None:
    """Release what ``fn`` holds in the running event loop (a judge's HTTP client): called by
    whoever runs the loop, as it ends. A reward without an ``aclose`` holds nothing."""
    aclose = getattr(fn, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):  # a producer being cancelled still closes it
            await aclose()


def _finite(value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


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
