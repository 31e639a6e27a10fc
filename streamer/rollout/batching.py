"""Coalesce concurrent engine calls on an in-process model into one batched generate.

Multi-turn rollouts run their G episodes as independent coroutines, each making its own
engine calls. On a local transformers model, G separate ``generate`` calls cost G times
one batched call; a server batches on its own, a local model does not. The
:class:`MicroBatcher` collects every call made while the event loop is busy elsewhere
(all episodes waiting for their next turn reach it at once), groups them by sampling
settings and runs each group as one ``sample_many`` in a worker thread.

The first caller yields a few times to the event loop, which lets every episode that is
ready to sample submit too, then generates. Calls arriving during a generate wait for the
next batch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from streamer.rollout.contract import Completion

# (prompts, n, settings) -> completions per prompt
RunBatch = Callable[..., Awaitable[list[list[Completion]]]]
YIELDS = 3  # event-loop turns the first caller waits for others to join its batch


@dataclass
class _Call:
    prompt: list[int]
    key: tuple  # the sorted sampling settings: calls batch only with equal keys
    seed: int | None
    done: anyio.Event = field(default_factory=anyio.Event)
    result: list[Completion] | None = None
    error: BaseException | None = None


class MicroBatcher:
    def __init__(self, run_batch: RunBatch):
        self.run_batch = run_batch
        self._queue: list[_Call] = []
        self._flushing = False
        self.batches = 0  # generate calls made (for tests and logs)

    async def sample(self, prompt_ids: list[int], *, seed: int | None = None, **settings) -> list[Completion]:
        """:meth:`Sampler.sample`'s call, answered from a batch of every call with the same
        ``settings`` (n, temperature, top_p, max_new_tokens)."""
        call = _Call(list(prompt_ids), tuple(sorted(settings.items())), seed)
        self._queue.append(call)
        if not self._flushing:
            self._flushing = True
            try:
                with anyio.CancelScope(shield=True):  # others wait on this batch: finish it
                    await turns()
                    await self._flush()
            finally:
                self._flushing = False
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    async def _flush(self) -> None:
        while self._queue:
            key = self._queue[0].key
            batch = [c for c in self._queue if c.key == key]
            self._queue = [c for c in self._queue if c.key != key]
            self.batches += 1
            try:
                out = await self.run_batch([c.prompt for c in batch], **dict(key), seed=batch[0].seed)
                for c, completions in zip(batch, out, strict=True):
                    c.result = completions
            except Exception as e:  # every call of the batch fails with it
                for c in batch:
                    c.error = e
            for c in batch:
                c.done.set()


async def turns(n: int = YIELDS) -> None:
    """``n`` turns of the event loop: what was ready to run has run."""
    for _ in range(n):
        await anyio.sleep(0)
