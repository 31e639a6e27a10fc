"""Rollout contexts and a scripted sampler, for tests that run a rollout without a producer."""

from __future__ import annotations

import anyio

from streamer.rollout.contract import Completion, RolloutContext, SampleFn, Task


def context(task: Task, sample_fn: SampleFn, **over) -> RolloutContext:
    """A context for ``task`` that samples through ``sample_fn``: one episode a row, temperature
    and top-p 1, at most 4 new tokens, seed 1; ``over`` replaces any of these fields."""
    fields = {"group_size": 1, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 1} | over
    return RolloutContext(task=task, sample_fn=sample_fn, **fields)


def threaded(sampler, version: int = 0) -> SampleFn:
    """A ``sample_fn`` that calls the blocking ``sampler.sample`` in a worker thread, as a
    producer does, and stamps each completion with ``version``."""

    async def sample_fn(prompt_ids, **kwargs) -> list[Completion]:
        out = await anyio.to_thread.run_sync(lambda: sampler.sample(prompt_ids, **kwargs))
        return [Completion(c.token_ids, c.logprobs, c.finish_reason, version) for c in out]

    return sample_fn


class Scripted:
    """A sampler that answers every prompt with the same text (+ the stop token, cut at
    ``max_new_tokens``), keeping each prompt it was asked to complete."""

    def __init__(self, renderer, text: str = "5"):
        self.renderer = renderer
        self.ids = [*renderer.tokenizer.encode(text, add_special_tokens=False), renderer.stop_ids[0]]
        self.prompts: list[list[int]] = []

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        self.prompts.append(list(prompt_ids))
        ids = self.ids[:max_new_tokens]
        finish = "stop" if ids[-1] == self.ids[-1] else "length"
        return [Completion(list(ids), [-0.5] * len(ids), finish) for _ in range(n)]

    def load_weights(self, directory) -> None:
        raise AssertionError("no weights in these tests")

    def close(self) -> None:
        pass
