"""Checking a rollout's episodes into wire :class:`Sample` s.

A rollout function is user code: whatever it returns is untrusted until
:func:`to_samples` has checked it. An episode that is malformed (segment lengths differ,
loss weight on tokens it did not sample, token ids that are not integers inside the
vocabulary, a version that is not an integer between 0 and the newest published one,
log-probs that are NaN, infinite or positive, a reward that is not a finite number),
longer than ``max_seq_len``, or of more than ``max_forks`` forks (each fork is one more
sample of the group, so the forks of one episode could make a group of any size) raises
:class:`EpisodeRejected` with a reason from :data:`REASONS`; the producer counts it and
the episode never reaches the trainer. A log-prob up to :data:`LOGPROB_TOLERANCE` above 0
is an engine's rounding (p = 1 in float arithmetic), trained as 0.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from schemas import Sample, Span
from schemas.events import LOGPROB_DTYPE, TOKEN_DTYPE
from schemas.metric_names import EPISODE_DROP_REASONS
from streamer.errors import EpisodeRejected
from streamer.rollout.contract import Episode, Segment

# why an episode (or a whole rollout) was dropped: counted as rollout `episodes_dropped_{reason}`
REASONS = EPISODE_DROP_REASONS
LOGPROB_TOLERANCE = 1e-4  # a log-prob this far above 0 is float error (p = 1), trained as 0
MAX_VERSION = 2**63 - 1  # the wire's version field is an int64
MAX_FORKS = 64  # producer.max_forks' default
FLOAT32_MAX = float(np.finfo(LOGPROB_DTYPE).max)  # a log-prob past it is sent as inf


def check_group(
    episodes: list, *, vocab_size: int, max_seq_len: int, max_version: int, max_forks: int
) -> tuple[list[tuple[list[Sample], Episode]], list[EpisodeRejected]]:
    """(its samples, the episode) of each episode that passes :func:`to_samples`, numbered by
    its place in ``episodes``, and why each of the others did not."""
    good, rejected = [], []
    check = dict(vocab_size=vocab_size, max_seq_len=max_seq_len, max_version=max_version, max_forks=max_forks)
    for i, e in enumerate(episodes):
        try:
            good.append((to_samples(e, **check, index=i), e))
        except EpisodeRejected as err:
            rejected.append(err)
    return good, rejected


def vocab_size(tokenizer, sampler) -> int:
    """Token ids at or above this are malformed: the larger of tokenizer and model vocab."""
    model = getattr(sampler, "model", None)
    return max(len(tokenizer), int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0))


def to_samples(
    episode: Episode,
    *,
    vocab_size: int,
    max_seq_len: int = 0,
    max_version: int = MAX_VERSION,
    max_forks: int = MAX_FORKS,
    index: int = 0,
) -> list[Sample]:
    """The wire form of a checked episode: one sample per piece (its forks, then the last),
    numbered ``index`` when there are several; :class:`EpisodeRejected` says what is wrong,
    and in which piece. One bad piece, or more than ``max_forks`` forks, rejects the whole
    episode."""
    if not isinstance(episode, Episode):
        raise EpisodeRejected("malformed", f"rollout returned {type(episode).__name__}, not an Episode")
    check = dict(vocab_size=vocab_size, max_seq_len=max_seq_len, max_version=max_version)
    if not isinstance(episode.forks, (list, tuple)):
        raise EpisodeRejected("malformed", f"forks is {type(episode.forks).__name__}, not a list of pieces")
    if len(episode.forks) > max_forks:
        raise EpisodeRejected(
            "too_many_forks",
            f"{len(episode.forks)} forks > producer.max_forks {max_forks} "
            f"(the episode would be {len(episode.forks) + 1} samples)",
        )
    if not episode.forks:
        return [to_sample(episode, **check)]
    pieces = [*episode.forks, episode.segments]
    out = []
    for k, segments in enumerate(pieces):
        finish = episode.finish_reason if k == len(pieces) - 1 else "stop"  # the episode went on
        try:
            sample = to_sample(Episode(segments, episode.reward, finish), **check)
        except EpisodeRejected as e:
            why = str(e).removeprefix(f"{e.reason}: ")
            raise EpisodeRejected(e.reason, f"fork {k + 1} of {len(pieces)}: {why}") from None
        out.append(msgspec.structs.replace(sample, episode=index))
    return out


def to_sample(
    episode: Episode, *, vocab_size: int, max_seq_len: int = 0, max_version: int = MAX_VERSION
) -> Sample:
    """The wire form of a checked single-piece episode (its forks ignored: see
    :func:`to_samples`); :class:`EpisodeRejected` says what is wrong.

    ``max_version``: the newest policy version published, which no sampled segment may exceed.
    """
    try:
        return _to_sample(episode, vocab_size=vocab_size, max_seq_len=max_seq_len, max_version=max_version)
    except EpisodeRejected:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError) as e:  # junk where a list or number goes
        raise EpisodeRejected("malformed", f"{type(e).__name__}: {e}") from None


def _to_sample(episode: Episode, *, vocab_size: int, max_seq_len: int, max_version: int) -> Sample:
    if not isinstance(episode, Episode):
        raise EpisodeRejected("malformed", f"rollout returned {type(episode).__name__}, not an Episode")
    segs = episode.segments
    if len(segs) < 2 or not isinstance(segs[0], Segment) or segs[0].sampled:
        raise EpisodeRejected("malformed", "an episode is a prompt segment followed by at least one more")
    tokens, logprobs, mask, spans = list(segs[0].tokens), [], [], []
    for i, s in enumerate(segs[1:], 1):
        _check_segment(i, s, max_version)
        if s.sampled:
            spans.append(Span(len(logprobs), len(logprobs) + len(s.tokens), int(s.version)))
        tokens += s.tokens
        logprobs += s.logprobs if s.sampled else [0.0] * len(s.tokens)
        mask += s.weights()
    if not tokens[len(segs[0].tokens) :] or not segs[0].tokens:
        raise EpisodeRejected("malformed", "empty prompt or nothing after it")
    if not spans:
        raise EpisodeRejected("malformed", "no sampled segment")
    ids = _token_ids(tokens, vocab_size)
    lps = _logprobs(logprobs)
    if max_seq_len and len(tokens) > max_seq_len:
        raise EpisodeRejected("too_long", f"{len(tokens)} tokens > max_seq_len {max_seq_len}")
    if not _finite(episode.reward):
        raise EpisodeRejected("bad_reward", f"reward {episode.reward!r:.40} is not a finite number")
    single = len(spans) == 1 and spans[0].start == 0 and spans[0].end == len(logprobs)
    return Sample.packed(
        ids,
        lps,  # int32 and float32 already: packed as checked
        prompt_len=len(segs[0].tokens),
        reward=float(episode.reward),
        finish_reason=episode.finish_reason if episode.finish_reason in ("stop", "length") else "stop",
        version=min(s.version for s in spans),
        mask=None if all(mask) else mask,
        spans=None if single else spans,
    )


def _check_segment(i: int, s: Segment, max_version: int) -> None:
    if not isinstance(s, Segment):
        raise EpisodeRejected("malformed", f"segment {i} is {type(s).__name__}, not a Segment")
    if s.sampled and len(s.logprobs) != len(s.tokens):
        raise EpisodeRejected(
            "malformed", f"segment {i}: {len(s.tokens)} tokens but {len(s.logprobs)} log-probs"
        )
    if s.sampled and s.version is None:
        raise EpisodeRejected("malformed", f"segment {i}: sampled without a policy version")
    if s.sampled and (not _integer(s.version) or not 0 <= s.version <= max_version):
        raise EpisodeRejected(
            "malformed", f"segment {i}: version {s.version!r:.40} was never published (newest: {max_version})"
        )
    if s.mask is None:  # the default weights: 1 per sampled token, 0 per other
        return
    if len(s.mask) != len(s.tokens) or any(x not in (0, 1) for x in s.mask):
        raise EpisodeRejected("malformed", f"segment {i}: mask must be one 0/1 per token")
    if not s.sampled and any(s.mask):
        raise EpisodeRejected("malformed", f"segment {i}: loss weight on tokens it did not sample")


def claimed_version(episodes: list) -> int:
    """The newest policy version any sampled segment of ``episodes`` names (0: none does)."""
    return max(
        (
            s.version
            for e in episodes
            if isinstance(e, Episode) and isinstance(e.forks, (list, tuple))
            for piece in [*e.forks, e.segments]
            if isinstance(piece, (list, tuple))
            for s in piece
            if isinstance(s, Segment) and _integer(s.version)
        ),
        default=0,
    )


def _token_ids(tokens: list, vocab_size: int) -> np.ndarray:
    """``tokens`` as int32, every id an integer in ``[0, vocab_size)``."""
    try:
        ids = np.asarray(tokens, np.int64)
    except (OverflowError, ValueError, TypeError):  # past int64, None, text: name the first
        bad = next((t for t in tokens if not (_integer(t) and 0 <= t < vocab_size)), tokens)
    else:
        if ids.ndim != 1:
            raise EpisodeRejected("bad_token", "token ids must be a flat list of integers")
        if ids.view(np.uint64).max() < vocab_size:  # a negative id is past 2**63 as unsigned
            return ids.astype(TOKEN_DTYPE)
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
    if not _integer(bad):
        raise EpisodeRejected("bad_token", f"token id {bad!r:.40} is not an integer")
    raise EpisodeRejected("bad_token", f"token id {bad} outside the vocabulary [0, {vocab_size})")


def _logprobs(logprobs: list) -> np.ndarray:
    """``logprobs`` as float32, checked as sent: finite in float32 (a float64 beyond its range
    would arrive as inf) and at most 0, up to :data:`LOGPROB_TOLERANCE` (trained as 0)."""
    lps = np.asarray(logprobs, np.float64)
    low, high = lps.min(), lps.max()  # NaN if any is
    if not -FLOAT32_MAX <= low <= high <= FLOAT32_MAX:
        raise EpisodeRejected("bad_logprob", "a sampled token's log-prob is NaN or infinite")
    lps = lps.astype(LOGPROB_DTYPE)
    if high > 0:  # a probability above 1; within the tolerance, an engine's rounding of 0
        if lps.max() > LOGPROB_TOLERANCE:
            raise EpisodeRejected("bad_logprob", f"a sampled token's log-prob is {lps.max():g} > 0")
        np.minimum(lps, 0, out=lps)
    return lps


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _finite(x) -> bool:
    """A real number that fits a float and is finite (an int past 1e308 does not)."""
    if not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
