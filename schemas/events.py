"""The wire contract: every fact that crosses a process boundary is one of these events.

Frozen, tagged msgspec Structs encoded as MessagePack. Token ids and log-probs travel as
packed little-endian int32 / float32 bytes (cheap to encode, zero-copy numpy views to
read: a decoded Sample's packed fields are read-only memoryviews into the payload, never
copies). Validation that training depends on runs in ``__post_init__``, so a payload that
decodes is a payload the trainer can use; anything else is a decode error.
"""

from __future__ import annotations

import math
import os
import time
from typing import Literal

import msgspec
import numpy as np

SCHEMA_VERSION = 3
# 2 added Sample.spans (per-turn versions), 3 Sample.episode (forks); an older event is a newer one
# without them. A build that reads only 1-2 would train the forks of one episode as separate
# episodes (wrong advantages), so it refuses schema 3 instead.
READABLE_SCHEMAS = (1, 2, 3)

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")

FinishReason = Literal["stop", "length", "abort"]
Axis = Literal["train", "rollout", "eval"]


def _event_id() -> str:
    return os.urandom(8).hex()


def _check_schema(v: int) -> None:
    if v not in READABLE_SCHEMAS:
        readable = ", ".join(map(str, READABLE_SCHEMAS))
        raise ValueError(f"unknown schema version {v} (this build reads {readable})")


def _check_version(name: str, v: int) -> None:
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")


class Span(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Completion tokens ``[start, end)`` sampled by policy ``version`` (one assistant turn)."""

    start: int
    end: int
    version: int


# gc=False: Samples and groups hold no references that could form a cycle, so the cyclic GC
# need not track them; a trainer holding thousands of decoded groups then pays no GC passes.
class Sample(msgspec.Struct, frozen=True, tag="sample", kw_only=True, gc=False):
    """One completion of a prompt: prompt + completion tokens and what the sampler saw."""

    # packed fields are memoryviews so decoding is zero-copy (a view of the received payload)
    tokens: memoryview  # int32 LE: prompt tokens followed by completion tokens
    logprobs: memoryview  # float32 LE: sampler log-prob of each completion token
    prompt_len: int  # first trained position (per sample: multi-turn prompts differ)
    reward: float
    finish_reason: FinishReason
    version: int  # policy version that sampled this completion (oldest turn if multi-turn)
    mask: memoryview | None = None  # uint8 per completion token, 1 = trained; None = all trained
    # sampled turns of a multi-turn sample, in order; tokens outside every span (tool results,
    # environment messages) were not sampled and must have mask 0. None = one turn: the whole
    # completion, sampled by `version`. (schema 2; a schema-1 event has none)
    spans: list[Span] | None = None
    # samples of one group with the same number are the forks of one episode (a conversation
    # whose re-rendered history broke the token prefix): one reward, one advantage. None = an
    # episode of its own. (schema 3)
    episode: int | None = None

    def __post_init__(self) -> None:
        n_tok, rem = divmod(len(self.tokens), 4)
        n_lp, rem_lp = divmod(len(self.logprobs), 4)
        if rem or rem_lp:
            raise ValueError("tokens/logprobs byte length is not a multiple of 4")
        if not 0 < self.prompt_len < n_tok:
            raise ValueError(f"prompt_len {self.prompt_len} outside (0, {n_tok}) tokens")
        if n_lp != n_tok - self.prompt_len:
            raise ValueError(f"{n_lp} logprobs for {n_tok - self.prompt_len} completion tokens")
        if self.mask is not None and len(self.mask) != n_lp:
            raise ValueError(f"mask has {len(self.mask)} entries for {n_lp} completion tokens")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward is not finite: {self.reward}")
        _check_version("version", self.version)
        if self.episode is not None:
            _check_version("episode", self.episode)
        if self.spans is not None:
            self._check_spans(n_lp)

    def _check_spans(self, n: int) -> None:
        if not self.spans:
            raise ValueError("spans is empty (use None for a single-turn sample)")
        at = 0
        for s in self.spans:
            if not at <= s.start < s.end <= n:
                raise ValueError(f"span [{s.start}, {s.end}) overlaps or lies outside [{at}, {n})")
            _check_version("span version", s.version)
            at = s.end
        oldest = min(s.version for s in self.spans)
        if self.version != oldest:
            raise ValueError(f"version {self.version} != oldest span version {oldest}")
        if self.mask is not None:
            inside = np.zeros(n, bool)
            for s in self.spans:
                inside[s.start : s.end] = True
            if np.frombuffer(self.mask, np.uint8)[~inside].any():
                raise ValueError("mask trains tokens outside every sampled span")

    @classmethod
    def build(
        cls,
        *,
        prompt_ids,
        completion_ids,
        logprobs,
        reward: float,
        finish_reason: FinishReason,
        version: int,
        mask=None,
        spans: list[Span] | None = None,
        episode: int | None = None,
    ) -> Sample:
        """Pack python/numpy sequences into the wire form."""
        tokens = np.concatenate(
            [np.asarray(prompt_ids, TOKEN_DTYPE), np.asarray(completion_ids, TOKEN_DTYPE)]
        )
        return cls.packed(
            tokens,
            logprobs,
            prompt_len=len(prompt_ids),
            reward=reward,
            finish_reason=finish_reason,
            version=version,
            mask=mask,
            spans=spans,
            episode=episode,
        )

    @classmethod
    def packed(
        cls,
        tokens,
        logprobs,
        *,
        prompt_len: int,
        reward: float,
        finish_reason: FinishReason,
        version: int,
        mask=None,
        spans: list[Span] | None = None,
        episode: int | None = None,
    ) -> Sample:
        """The wire form of prompt + completion ``tokens`` in one sequence (int32 and float32
        arrays are packed as they are, without a copy to convert them)."""
        return cls(
            tokens=memoryview(np.asarray(tokens, TOKEN_DTYPE).tobytes()),
            logprobs=memoryview(np.asarray(logprobs, LOGPROB_DTYPE).tobytes()),
            prompt_len=prompt_len,
            reward=float(reward),
            finish_reason=finish_reason,
            version=version,
            mask=None if mask is None else memoryview(np.asarray(mask, np.uint8).tobytes()),
            spans=spans,
            episode=episode,
        )

    def token_ids(self) -> np.ndarray:
        """(T,) int32 view of prompt + completion tokens (read-only, zero copy)."""
        return np.frombuffer(self.tokens, TOKEN_DTYPE)

    def completion_ids(self) -> np.ndarray:
        return self.token_ids()[self.prompt_len :]

    def sampler_logprobs(self) -> np.ndarray:
        """(T - prompt_len,) float32 view of the sampler's log-probs."""
        return np.frombuffer(self.logprobs, LOGPROB_DTYPE)

    def loss_mask(self) -> np.ndarray:
        """(T - prompt_len,) float32 weights of completion tokens."""
        n = len(self.logprobs) // 4
        if self.mask is None:
            return np.ones(n, np.float32)
        return np.frombuffer(self.mask, np.uint8).astype(np.float32)

    def token_versions(self) -> np.ndarray:
        """(T - prompt_len,) int64 policy version per completion token; -1 where not sampled."""
        n = len(self.logprobs) // 4
        if self.spans is None:
            return np.full(n, self.version, np.int64)
        out = np.full(n, -1, np.int64)
        for s in self.spans:
            out[s.start : s.end] = s.version
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def completion_len(self) -> int:
        return len(self.logprobs) // 4


class TrajectoryGroup(msgspec.Struct, frozen=True, tag="group", kw_only=True, gc=False):
    """The G samples of one prompt (a GRPO group), published with one XADD."""

    group_id: str
    row: int  # dataset row index
    epoch: int
    producer_id: str
    samples: list[Sample]
    policy_version: int  # oldest version among the samples (and all their turns)
    created_at: float  # when sampling started
    published_at: float = msgspec.field(default_factory=time.time)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_schema(self.schema)
        if not self.samples:
            raise ValueError("group has no samples")
        if not self.group_id:
            raise ValueError("group_id is empty")
        _check_version("policy_version", self.policy_version)
        _check_version("row", self.row)
        _check_version("epoch", self.epoch)
        oldest = min(s.version for s in self.samples)
        if self.policy_version != oldest:
            raise ValueError(f"policy_version {self.policy_version} != oldest sample version {oldest}")
        if any(s.episode is not None for s in self.samples):
            self._check_forks()

    def _check_forks(self) -> None:
        reward: dict[int, float] = {}
        for s in self.samples:
            if s.episode is not None and reward.setdefault(s.episode, s.reward) != s.reward:
                raise ValueError(
                    f"forks of episode {s.episode} have different rewards ({reward[s.episode]}, {s.reward})"
                )

    def rewards(self) -> np.ndarray:
        """(S,) float32 reward of each sample."""
        return np.array([s.reward for s in self.samples], np.float32)

    def episode_index(self) -> np.ndarray:
        """(S,) int64: each sample's episode, numbered 0..E-1 in order of first appearance.
        Forks of one episode share a number; a sample with ``episode`` None has its own."""
        if all(s.episode is None for s in self.samples):
            return np.arange(len(self.samples), dtype=np.int64)
        seen: dict[int, int] = {}
        out = np.empty(len(self.samples), np.int64)
        for i, s in enumerate(self.samples):
            key = -1 - i if s.episode is None else s.episode
            out[i] = seen.setdefault(key, len(seen))
        return out

    def episode_rewards(self) -> np.ndarray:
        """(E,) float32 reward of each episode (in :meth:`episode_index` order)."""
        if all(s.episode is None for s in self.samples):
            return self.rewards()
        first = np.unique(self.episode_index(), return_index=True)[1]
        return self.rewards()[first]


class WeightSync(msgspec.Struct, frozen=True, tag="weights", kw_only=True):
    """A new policy version: where its weights are and how to check them."""

    version: int
    step: int  # trainer step that produced these weights (not optimizer steps)
    uri: str  # file:// URI of a safetensors file (HF layout) or a directory holding one
    # sha256 of the directory's manifest.json, which lists every file's size and the BLAKE3 of
    # each of its 16 MiB pieces (streamer/weights.py); a reader refuses a manifest format it
    # does not know.
    sha256: str
    at: float = msgspec.field(default_factory=time.time)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_schema(self.schema)
        _check_version("version", self.version)
        _check_version("step", self.step)
        if len(self.sha256) != 64:
            raise ValueError("sha256 must be 64 hex characters")


class MetricsEvent(msgspec.Struct, frozen=True, tag="metrics", kw_only=True):
    """Named scalars at one step of one axis (train step, rollout batch, eval version)."""

    axis: Axis
    step: int
    values: dict[str, float]
    source: str  # "trainer", "producer-<id>", "eval"
    at: float = msgspec.field(default_factory=time.time)
    schema: int = SCHEMA_VERSION
    # random per event, fixed at construction: an XADD retried after a lost reply repeats the
    # same bytes, so a second entry with this id is a copy that readers skip ("" = no id)
    id: str = msgspec.field(default_factory=_event_id)
    eval_set: str = ""  # axis "eval": the eval set scored ("" = the set named "default")

    def __post_init__(self) -> None:
        _check_schema(self.schema)
        _check_version("step", self.step)


class DeadLetter(msgspec.Struct, frozen=True, tag="dead", kw_only=True):
    """An entry a consumer could not use, kept verbatim with the reason."""

    stream: str
    entry_id: str
    raw: bytes
    reason: str
    consumer: str = ""
    at: float = msgspec.field(default_factory=time.time)
    schema: int = SCHEMA_VERSION


Event = TrajectoryGroup | WeightSync | MetricsEvent | DeadLetter
