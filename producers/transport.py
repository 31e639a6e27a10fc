"""How a producer's event loop reaches the server and the engine: chosen once, from the sampler.

- A server engine (``max_parallel`` > 1), or a sampler without ``sample_many``: every engine
  call runs in a worker thread (at most ``max_parallel`` at once), and so does every Redis
  call (at most the rows in flight + 2).
- An in-process model: the engine calls of concurrent episodes are batched into one
  ``sample_many`` (:class:`streamer.rollout.batching.MicroBatcher`) in a worker thread, and
  the Redis calls run on the event loop itself (``inline``). Each is one short script
  (~0.1 ms to a local server), while a hop to a worker thread and back costs ~0.1-0.2 ms of
  CPU more than the call (two thread wake-ups and the GIL's hand-overs, on top of the
  generate's thread); the model's generate goes on meanwhile. A row's calls from its claim
  to its engine call then run in one go, so the rows of a wave reach the batcher together
  (the bare generate costs ~2.6 ms of CPU for one row of the demo and ~1 ms a row for
  eight). A call that may wait long, the publish that finds no room in the stream (or waits
  for replicas), goes to a worker thread. With one row in flight its engine calls run on
  the loop too, unbatched, when the row's rollout does nothing else meanwhile
  (``alone``: the built-in single turn, one engine call per row, with no rollout timeout to
  enforce mid-call).

Every engine call first loads a newer policy if there is one (the claim's reply says so,
else the policy stream is read), under the :class:`~producers.inflight.WeightGate`, and its
completions are stamped with the version that sampled them: an in-process model's here, a
server's token by token by the sampler (:mod:`producers.reload`). The turns of one episode,
and the tokens of one turn, may differ in version.
"""

from __future__ import annotations

import anyio

from producers.follow import WeightFollower
from producers.inflight import AdmissionWaits, WeightGate, blocking
from producers.trips import Trips
from streamer.rollout.batching import MicroBatcher
from streamer.rollout.contract import Completion


class Transport:
    """``redis(fn, *args)`` and ``sample(prompt_ids, **settings)``, for the whole run."""

    def __init__(
        self,
        sampler,
        *,
        follower: WeightFollower,
        trips: Trips,
        concurrency: int,
        reward_concurrency: int,
        alone: bool = False,
    ):
        self.sampler, self.follower, self.trips, self.pending = sampler, follower, trips, trips.pending
        self.max_parallel = getattr(sampler, "max_parallel", 1)
        self.concurrency, self.reward_concurrency = concurrency, reward_concurrency
        in_process = self.max_parallel == 1 and hasattr(sampler, "sample_many")
        alone = alone and concurrency == 1  # one engine call at a time: nothing to batch
        self.sample = (
            MicroBatcher(self._sample_batch).sample if in_process and not alone else self._sample_one
        )
        self.inline = in_process  # Redis calls on the event loop (see above)
        self.redis = self._inline if in_process else self.in_thread
        self._engine = self._inline if in_process and alone else self._engine_thread

    def start(self) -> None:
        """The parts that belong to one event loop (anyio's): first thing in each loop."""
        self.gate = WeightGate(exclusive=self.max_parallel == 1)
        self.admission_waits = AdmissionWaits()
        self._redis_limiter = anyio.CapacityLimiter(self.concurrency + 2)
        self._sample_limiter = anyio.CapacityLimiter(self.max_parallel)
        self.reward_limiter = anyio.CapacityLimiter(self.reward_concurrency)

    async def _inline(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    async def in_thread(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, a Redis call, in a worker thread (always: one that may wait)."""
        return await blocking(fn, *args, limiter=self._redis_limiter, **kwargs)

    async def _engine_thread(self, fn, *args, **kwargs):
        return await blocking(fn, *args, limiter=self._sample_limiter, **kwargs)

    async def _sample_one(self, prompt_ids: list[int], **kwargs) -> list[Completion]:
        """One engine call."""
        await self._follow_weights()
        async with self.gate.reading():
            version = self.follower.version
            out = await self._engine(self.sampler.sample, prompt_ids, **kwargs)
        return _stamped(out, version)

    async def _sample_batch(self, prompts: list[list[int]], **kwargs) -> list[list[Completion]]:
        """One batched generate of an in-process model."""
        await self._follow_weights()
        async with self.gate.reading():
            version = self.follower.version
            out = await self._engine(self.sampler.sample_many, prompts, **kwargs)
        return [_stamped(cs, version) for cs in out]

    async def _follow_weights(self) -> None:
        """Load a newer version, once no engine call is in flight (see WeightGate)."""
        fresh, sync = self.trips.policy_news()  # what the claim just said: no round trip of its own
        if not fresh:
            sync = await self.redis(self.trips.read_policy)
        f = self.follower
        if not f.due(sync):
            return
        async with self.gate.writing():
            if not f.due(sync):
                return  # another worker loaded it while we waited
            errors = f.errors
            if await blocking(f.load, sync):
                self.pending.weight_load_seconds = f.last_load_seconds
                self.pending.add("weight_loads")
            self.pending.add("weight_load_errors", f.errors - errors)


def _stamped(completions: list[Completion], version: int) -> list[Completion]:
    """Completions of an in-process model or an untracked server, stamped with ``version``; a
    server tracked per token (:mod:`producers.reload`) stamped its own."""
    # built directly: dataclasses.replace reads the fields anew for every completion
    return [
        c if c.version is not None else Completion(c.token_ids, c.logprobs, c.finish_reason, version)
        for c in completions
    ]
