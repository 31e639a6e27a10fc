"""The built-in rollout, loading a rollout (import path or service URL), checking episodes.

``producer.rollout = "http://host:port/path"`` makes every row a call to a **remote
rollout service**: ``POST`` the JSON below, receive the row's episodes token-native::

    request: {"row": {...}, "group_size": G, "seed": s, "max_seq_len": N,
              "sampling": {"temperature": t, "top_p": p, "max_new_tokens": m}}
    reply:   {"episodes": [{"segments": [{"tokens": [...]},                 # context
                                         {"tokens": [...], "logprobs": [...],
                                          "version": v}, ...],           # sampled
                            "reward": r, "finish_reason": "stop", "metrics": {...}}]}

A sampled segment names the policy version that sampled it (the service's engine
follows the run's weights; the proxy of :mod:`producers.proxy` is one way to). The reply
is untrusted: one that is not JSON or not of this shape drops the rollout with reason
``malformed`` and a message naming the field; an HTTP error drops it with reason
``error``; both hand the row back and count towards ``max_row_attempts``. A service
that cannot be reached, or answers 429/502/503/504, is an outage, not the row's
failure: the producer backs off as for a sampler outage.

A rollout function is user code: whatever it returns is untrusted until
:func:`to_sample` has checked it. An episode that is malformed (segment lengths differ,
loss weight on tokens it did not sample, ids outside the vocabulary, NaN log-probs, a
reward that is not a finite number) or longer than ``max_seq_len`` raises
:class:`EpisodeRejected` with a reason from :data:`REASONS`; the producer counts it and
the episode never reaches the trainer.
"""

from __future__ import annotations

import logging
import math

import httpx
import msgspec
import numpy as np

from producers.rewards import score
from schemas import Sample, Span
from schemas.events import LOGPROB_DTYPE
from schemas.metric_names import EPISODE_DROP_REASONS
from streamer.errors import EpisodeRejected, SamplerError
from streamer.imports import load_function
from streamer.rollout_types import DEFAULT_ROLLOUT, Episode, FinishReason, Rollout, RolloutContext, Segment

log = logging.getLogger(__name__)

# why an episode (or a whole rollout) was dropped: counted as rollout `episodes_dropped_{reason}`
REASONS = EPISODE_DROP_REASONS


async def single_turn(row: dict, ctx: RolloutContext) -> list[Episode]:
    """Render -> sample G completions in one call -> reward each (the default rollout)."""
    task = ctx.task
    prompt = task.renderer.render(row)
    completions = await ctx.sample(prompt, n=ctx.group_size)
    out = []
    for c in completions:
        if not c.token_ids:
            continue
        try:
            reward = score(task.reward_fn, row, task.renderer.decode(c.token_ids), c)
        except Exception as e:  # a user function: anything it raises marks the sample failed
            log.warning("reward %s raised %s: %s (sample dropped)", task.reward_path, type(e).__name__, e)
            continue
        segments = [Segment(prompt), Segment(list(c.token_ids), list(c.logprobs), c.version)]
        out.append(Episode(segments, reward, c.finish_reason))
    return out


def load(path: str) -> Rollout:
    """The rollout at import path ``path`` ("" = :func:`single_turn`), or a service URL."""
    if path.startswith(("http://", "https://")):
        return remote(path)
    return load_function(path or DEFAULT_ROLLOUT, what="rollout")


class _WireSegment(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    logprobs: list[float] | None = None
    version: int | None = None
    mask: list[int] | None = None


class _WireEpisode(msgspec.Struct, forbid_unknown_fields=True):
    segments: list[_WireSegment]
    reward: float
    finish_reason: FinishReason = "stop"
    metrics: dict[str, float] = {}


class _Reply(msgspec.Struct):
    episodes: list[_WireEpisode]


OUTAGE_STATUS = {429, 502, 503, 504}


def remote(url: str, *, timeout: float = 600.0) -> Rollout:
    """A rollout that POSTs each row to the rollout service at ``url`` (module docstring)."""

    async def rollout(row: dict, ctx: RolloutContext) -> list[Episode]:
        body = {
            "row": row,
            "group_size": ctx.group_size,
            "seed": ctx.seed,
            "max_seq_len": ctx.max_seq_len,
            "sampling": {
                "temperature": ctx.temperature,
                "top_p": ctx.top_p,
                "max_new_tokens": ctx.max_new_tokens,
            },
        }
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0)) as http:
                r = await http.post(url, json=body)
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout):
                raise SamplerError(f"rollout service {url} cannot be reached: {e!r}") from None
            raise TimeoutError(f"no answer within {timeout:.0f}s") from None
        except httpx.TransportError as e:
            raise SamplerError(f"rollout service {url} cannot be reached: {e!r}") from None
        if r.status_code in OUTAGE_STATUS:
            raise SamplerError(f"rollout service {url} answered {r.status_code}: {r.text[:200]}")
        if r.status_code != 200:
            raise RuntimeError(f"the service answered {r.status_code}: {r.text[:200]}")
        try:
            reply = msgspec.json.decode(r.content, type=_Reply)
        except msgspec.DecodeError as e:
            raise EpisodeRejected("malformed", f"sent a bad reply: {e}") from None
        return [
            Episode(
                [Segment(s.tokens, s.logprobs, s.version, s.mask) for s in e.segments],
                e.reward,
                e.finish_reason,
                dict(e.metrics),
            )
            for e in reply.episodes
        ]

    rollout.__name__ = rollout.__qualname__ = f"remote({url})"
    return rollout


def to_sample(episode: Episode, *, vocab_size: int, max_seq_len: int = 0) -> Sample:
    """The wire form of a checked episode; :class:`EpisodeRejected` says what is wrong."""
    if not isinstance(episode, Episode):
        raise EpisodeRejected("malformed", f"rollout returned {type(episode).__name__}, not an Episode")
    segs = episode.segments
    if len(segs) < 2 or segs[0].sampled:
        raise EpisodeRejected("malformed", "an episode is a prompt segment followed by at least one more")
    tokens, logprobs, mask, spans = list(segs[0].tokens), [], [], []
    for i, s in enumerate(segs[1:], 1):
        _check_segment(i, s)
        if s.sampled:
            spans.append(Span(len(logprobs), len(logprobs) + len(s.tokens), int(s.version)))
        tokens += s.tokens
        logprobs += s.logprobs if s.sampled else [0.0] * len(s.tokens)
        mask += s.weights()
    if not tokens[len(segs[0].tokens) :] or not segs[0].tokens:
        raise EpisodeRejected("malformed", "empty prompt or nothing after it")
    if not spans:
        raise EpisodeRejected("malformed", "no sampled segment")
    ids = np.asarray(tokens, np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise EpisodeRejected("bad_token", f"token id {bad} outside the vocabulary [0, {vocab_size})")
    # checked as sent: a float64 log-prob beyond float32's range would arrive as inf
    with np.errstate(over="ignore"):
        lps = np.asarray(logprobs, LOGPROB_DTYPE)
    if not np.isfinite(lps).all():
        raise EpisodeRejected("bad_logprob", "a sampled token's log-prob is NaN or infinite")
    if max_seq_len and len(tokens) > max_seq_len:
        raise EpisodeRejected("too_long", f"{len(tokens)} tokens > max_seq_len {max_seq_len}")
    if not isinstance(episode.reward, (int, float)) or not math.isfinite(episode.reward):
        raise EpisodeRejected("bad_reward", f"reward {episode.reward!r} is not a finite number")
    single = len(spans) == 1 and spans[0].start == 0 and spans[0].end == len(logprobs)
    return Sample.build(
        prompt_ids=segs[0].tokens,
        completion_ids=tokens[len(segs[0].tokens) :],
        logprobs=lps,  # float32 already: packed as checked
        reward=float(episode.reward),
        finish_reason=episode.finish_reason if episode.finish_reason in ("stop", "length") else "stop",
        version=min(s.version for s in spans),
        mask=None if single and all(mask) else mask,
        spans=None if single else spans,
    )


def _check_segment(i: int, s: Segment) -> None:
    if not isinstance(s, Segment):
        raise EpisodeRejected("malformed", f"segment {i} is {type(s).__name__}, not a Segment")
    if s.sampled and len(s.logprobs) != len(s.tokens):
        raise EpisodeRejected(
            "malformed", f"segment {i}: {len(s.tokens)} tokens but {len(s.logprobs)} log-probs"
        )
    if s.sampled and (not isinstance(s.version, int) or s.version < 0):
        raise EpisodeRejected("malformed", f"segment {i}: sampled without a policy version")
    if s.mask is None:  # the default weights: 1 per sampled token, 0 per other
        return
    if len(s.mask) != len(s.tokens) or any(x not in (0, 1) for x in s.mask):
        raise EpisodeRejected("malformed", f"segment {i}: mask must be one 0/1 per token")
    if not s.sampled and any(s.mask):
        raise EpisodeRejected("malformed", f"segment {i}: loss weight on tokens it did not sample")
