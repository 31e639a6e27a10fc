"""The typed contract of the extension points: rollouts, samplers, rewards.

A producer's work per dataset row is a **rollout function**, named by import path in
``producer.rollout`` (``"pkg.module:fn"``)::

    async def rollout(row: dict, ctx: RolloutContext) -> list[Episode]: ...

It returns the G episodes of the row's group. It may call the sampler as often as it likes
(``await ctx.sample(prompt_ids, n=...)``), and returns each episode as token-native
:class:`Segment` s: context tokens (the prompt, tool results, environment messages: never
trained) and sampled tokens (with the sampler's log-prob of each token and the policy
version that sampled them). Text is never re-tokenized; :mod:`streamer.rollout.trajectory` folds
successive engine calls into one episode and enforces the prefix invariant.

Write the G episodes as independent coroutines with :func:`episodes`: it runs
``fn(row, ctx, index)`` G times concurrently. The built-in single-turn rollout
(:func:`producers.single_turn.single_turn`) instead samples all G at once (one batched call).

Everything the evaluator and the producers share lives here, so ``consumers/`` needs
nothing from ``producers/`` to name these types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from schemas.events import FinishReason
from streamer.errors import SamplerError


@dataclass(frozen=True, slots=True)
class Completion:
    """What one engine call sampled: completion ids, one log-prob each, why it ended."""

    token_ids: list[int]  # completion tokens, ending with the stop token when finish == "stop"
    logprobs: list[float]  # one per token: log-prob under the sampling distribution
    finish_reason: FinishReason
    version: int | None = None  # policy version that sampled it (the first one, if several did)
    # the weights changed during the call: (index of the first token, version) of each run of
    # tokens one version sampled, in order, the first at index 0. None: ``version`` sampled all
    switches: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise SamplerError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")

    def runs(self) -> list[tuple[int, int, int]]:
        """``(start, end, version)`` of each run of tokens one policy version sampled."""
        if self.switches is None:
            return [(0, len(self.token_ids), self.version)] if self.token_ids else []
        starts = [*self.switches, (len(self.token_ids), -1)]
        return [(a, b, v) for (a, v), (b, _) in zip(starts, starts[1:]) if b > a]

    def segments(self) -> list[Segment]:
        """The sampled segments of this call, one per policy version that sampled part of it."""
        return [Segment(self.token_ids[a:b], self.logprobs[a:b], v) for a, b, v in self.runs()]


class Sampler(Protocol):
    """Everything producers and the evaluator call on a sampler (blocking calls)."""

    def sample(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | None = None,
    ) -> list[Completion]: ...

    def load_weights(self, directory: Path) -> None:
        """Switch to the safetensors weights in ``directory`` (raise on failure)."""
        ...

    def close(self) -> None: ...


class Renderer(Protocol):
    """Rows and messages -> token ids through the model's tokenizer (producers.render)."""

    stop_ids: list[int]
    tokenizer: object

    def render(self, row: dict) -> list[int]: ...

    def render_suffix(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, ids) -> str: ...


RewardFn = Callable[..., float]  # (row, completion_text, completion) -> float


@dataclass(frozen=True)
class Task:
    """What turns rows into rewards: the rows, the renderer, the reward function."""

    rows: Sequence[dict]  # a list, or rows read on demand from a file (producers.lazy_rows.Rows)
    renderer: Renderer
    reward_fn: RewardFn
    reward_path: str


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of tokens of one episode: context (no log-probs, never trained) or sampled."""

    tokens: list[int]
    logprobs: list[float] | None = None  # sampled: the sampler's log-prob of each token
    version: int | None = None  # sampled: the policy version that sampled it
    mask: list[int] | None = None  # per-token loss weight 0/1; None = 1 if sampled, else 0

    @property
    def sampled(self) -> bool:
        return self.logprobs is not None

    def weights(self) -> list[int]:
        if self.mask is not None:
            return list(self.mask)
        return [1 if self.sampled else 0] * len(self.tokens)


@dataclass(slots=True)
class Episode:
    """One trajectory: segments (the first is the prompt), the reward, metrics.

    An episode whose later prompts stopped extending its tokens (a chat template that drops
    earlier ``<think>`` blocks when the history is rendered again) is several prefix-consistent
    pieces: ``forks`` holds the earlier ones in order, each a prompt segment and what followed
    it; ``segments`` is the last. Each piece is trained as a sample of its own, with its own
    prompt and per-turn versions, and all share the episode's reward and advantage.
    """

    segments: list[Segment]
    reward: float
    finish_reason: FinishReason = "stop"
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. turns, tool_calls
    forks: list[list[Segment]] = field(default_factory=list)  # earlier pieces (see above)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]


SampleFn = Callable[..., Awaitable[list[Completion]]]


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout gets besides its row: the task, the group size, and the sampler.

    ``sample`` is the producer's: it stamps each completion with the policy version that
    sampled it and never blocks the other episodes in flight.
    """

    task: Task
    group_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    sample_fn: SampleFn
    max_seq_len: int = 0  # 0 = no limit
    reward_limiter: object | None = None  # bounds async reward calls across the producer's rows
    reward_timeout: float = 0.0  # seconds per async reward call; 0 = none

    async def sample(
        self, prompt_ids: list[int], *, n: int = 1, max_new_tokens: int | None = None, seed: int | None = None
    ) -> list[Completion]:
        """``n`` completions of ``prompt_ids`` with the run's sampling settings."""
        return await self.sample_fn(
            list(prompt_ids),
            n=n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            seed=self.seed if seed is None else seed,
        )

    def with_seed(self, seed: int) -> RolloutContext:
        return dataclasses.replace(self, seed=seed)


Rollout = Callable[[dict, RolloutContext], Awaitable[Sequence[Episode]]]
DEFAULT_ROLLOUT = "producers.single_turn:single_turn"  # loaded by producers.components.load_rollout


EpisodeFn = Callable[[dict, RolloutContext, int], Awaitable[Episode]]


def episodes(fn: EpisodeFn) -> Rollout:
    """A rollout running ``fn(row, ctx, i)`` for i in range(G) as concurrent episodes."""
    import functools

    import anyio

    @functools.wraps(fn)
    async def rollout(row: dict, ctx: RolloutContext) -> list[Episode]:
        out: list[Episode | None] = [None] * ctx.group_size

        async def one(i: int) -> None:
            out[i] = await fn(row, ctx.with_seed(ctx.seed * 7919 + i), i)

        async with anyio.create_task_group() as tg:
            for i in range(ctx.group_size):
                tg.start_soon(one, i)
        return [e for e in out if e is not None]

    return rollout
