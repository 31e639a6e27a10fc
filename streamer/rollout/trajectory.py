"""Fold successive engine calls into one token-native trajectory (the prefix invariant).

A multi-turn episode is trained on the tokens the model really saw and sampled. Each
engine call's prompt must therefore *start with every token accumulated so far*; what it
adds beyond them (a tool result, an environment message, the next generation prompt) is
context with loss weight 0, and what the call samples is a new trained segment stamped
with the policy version that sampled it. Text is never re-tokenized: the next prompt is
the accumulated tokens plus the rendered tokens of the new messages
(:meth:`Trajectory.append_messages`), never a fresh render of the whole history, which
may tokenize an earlier turn differently (a different merge, a stripped thinking block,
a missing newline). A prompt that breaks the prefix raises :class:`PrefixMismatch` with
the first divergent index; the producer counts it and never trains the episode.

``fork=True`` accepts such a prompt instead: the tokens so far become a finished piece of
the episode (:attr:`Episode.forks`) and the prompt starts the next piece. That is what a
chat template that drops earlier ``<think>`` blocks needs, when the history can only be
re-rendered whole: every piece is still token-exact and each sampled token is trained once,
in the piece that sampled it (a later piece's prompt holds it as context, weight 0).

``max_trim_tokens`` (the seed cookbook's): a prompt may drop up to that many trailing
tokens of the last sampled turn (a template that strips a trailing newline or a stop
token); those tokens are cut from the trajectory too, so it still holds only what the
model saw.
"""

from __future__ import annotations

from streamer.errors import PrefixMismatch
from streamer.rollout.contract import Completion, Episode, Segment


class Trajectory:
    """One episode under construction: a prompt, then engine calls and context tokens."""

    def __init__(self, prompt_ids: list[int], *, max_trim_tokens: int = 0, fork: bool = False):
        if not prompt_ids:
            raise ValueError("a trajectory starts with a non-empty prompt")
        self.segments: list[Segment] = [Segment([int(t) for t in prompt_ids])]
        self.tokens: list[int] = list(self.segments[0].tokens)
        self.max_trim_tokens = max_trim_tokens
        self.fork = fork  # a prompt that breaks the prefix starts a new piece instead of raising
        self.forks: list[list[Segment]] = []  # finished pieces, in order
        self.calls = 0  # engine calls folded in (= sampled turns)
        self.trimmed = 0  # tokens cut by max_trim_tokens
        self.finish_reason = "stop"

    def next_prompt(self) -> list[int]:
        """The prompt of the next engine call: everything so far."""
        return list(self.tokens)

    def extend(self, prompt_ids: list[int], completion: Completion) -> None:
        """Fold in one engine call: its prompt (checked against the prefix) and its sample."""
        if completion.version is None:
            raise ValueError("the completion carries no policy version (sample through ctx.sample)")
        prompt = [int(t) for t in prompt_ids]
        try:
            self._align(prompt)
        except PrefixMismatch:
            if not self.fork or not prompt:
                raise
            self._start_piece(prompt)
        self.calls += 1
        for seg in completion.segments():  # one per version, if the weights changed mid-call
            self.segments.append(seg)
            self.tokens += seg.tokens
        self.finish_reason = completion.finish_reason

    def append(self, token_ids: list[int]) -> None:
        """Context tokens (tool output, environment message): in the context, weight 0."""
        if token_ids:
            self.segments.append(Segment([int(t) for t in token_ids]))
            self.tokens += self.segments[-1].tokens

    def append_messages(self, renderer, messages: list[dict]) -> list[int]:
        """Append the rendered tokens of ``messages`` (+ generation prompt); the next prompt."""
        self.append(renderer.render_suffix(messages))
        return self.next_prompt()

    def episode(self, reward: float, **metrics: float) -> Episode:
        """The finished episode (``turns`` = engine calls unless given)."""
        metrics.setdefault("turns", float(self.calls))
        return Episode(
            list(self.segments),
            reward,
            self.finish_reason,
            {k: float(v) for k, v in metrics.items()},
            forks=[list(p) for p in self.forks],
        )

    def _start_piece(self, prompt: list[int]) -> None:
        """Close the tokens so far as a piece (if anything in it was sampled); ``prompt`` opens the next."""
        if any(s.sampled for s in self.segments):
            self.forks.append(self.segments)
        self.segments = [Segment(prompt)]
        self.tokens = list(prompt)

    def _align(self, prompt: list[int]) -> None:
        n = len(self.tokens)
        i = next((k for k, (a, b) in enumerate(zip(self.tokens, prompt)) if a != b), min(n, len(prompt)))
        if i == n:  # the prompt extends the trajectory; anything new in it is context
            self.append(prompt[n:])
            return
        last = self.segments[-1]
        start = n - len(last.tokens)
        if last.sampled and i >= start and n - i <= self.max_trim_tokens:
            keep = i - start
            self.segments[-1] = Segment(last.tokens[:keep], last.logprobs[:keep], last.version)
            if not keep:
                self.segments.pop()
            self.trimmed += n - i
            self.tokens = self.tokens[:i]
            self.append(prompt[i:])
            return
        raise PrefixMismatch(
            i, self.tokens[i] if i < n else None, prompt[i] if i < len(prompt) else None, self.calls + 1
        )
