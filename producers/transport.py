"""How a producer's event loop reaches the server and the engine: chosen once, from the sampler.

- A server engine (``max_parallel`` > 1), or a sampler without ``sample_many``: every engine
  call runs in a worker thread (at most ``max_parallel`` at once), and so does every Redis
  call (at most the rows in flight + 2).
- An in-process model: the engine calls of concurrent episodes are batched into one
  ``sample_many`` (:class:`streamer.rollout.batching.MicroBatcher`). A batch's first call
  waits until no Redis call of this producer is in flight (at most :data:`SETTLE` seconds):
  the rows whose claim or publish is on its way then come on and join it, instead of each
  wave of rows that finished a batch together being split between the next two or three
  (the bare generate costs ~2.6 ms of CPU for one row of the demo and ~1 ms a row for
  eight). With one row in flight its
  Redis calls run on the event loop itself: while one runs the loop has nothing else to
  do, and a thread hop costs more CPU than the call. So do its engine calls, unbatched,
  when the row's rollout does nothing else meanwhile either (``alone``: the built-in single
  turn, one engine call per row, with no rollout timeout to enforce mid-call).

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
from streamer.rollout.batching import MicroBatcher, turns
from streamer.rollout.contract import Completion

SETTLE = 0.005  # seconds a batch waits at most for the Redis calls in flight to answer


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
            MicroBatcher(self._sample_batch, self._settle).sample
            if in_process and not alone
            else self._sample_one
        )
        self.redis = self._inline if in_process and concurrency == 1 else self._in_thread
        self._engine = self._inline if in_process and alone else self._engine_thread

    def start(self) -> None:
        """The parts that belong to one event loop (anyio's): first thing in each loop."""
        self.gate = WeightGate(exclusive=self.max_parallel == 1)
        self.admission_waits = AdmissionWaits()
        self._redis_limiter = anyio.CapacityLimiter(self.concurrency + 2)
        self._redis_calls = 0  # in worker threads now
        self._redis_quiet = anyio.Event()  # set when the last of them answers
        self._sample_limiter = anyio.CapacityLimiter(self.max_parallel)
        self.reward_limiter = anyio.CapacityLimiter(self.reward_concurrency)

    async def _inline(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    async def _in_thread(self, fn, *args, **kwargs):
        if self._redis_calls == 0:
            self._redis_quiet = anyio.Event()
        self._redis_calls += 1
        try:
            return await blocking(fn, *args, limiter=self._redis_limiter, **kwargs)
        finally:
            self._redis_calls -= 1
            if self._redis_calls == 0:
                self._redis_quiet.set()

    async def _settle(self) -> None:
        """Until no Redis call is in flight and what its answers let run has run (the rows
        it answered reach the engine), or :data:`SETTLE` seconds."""
        with anyio.move_on_after(SETTLE):
            while self._redis_calls:
                await self._redis_quiet.wait()
                await turns()

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
