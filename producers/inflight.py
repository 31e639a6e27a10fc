"""Helpers for many rollouts in flight in one producer (anyio).

- :class:`WeightGate`: engine calls share the sampler. For an in-process model
  (``exclusive``), loading new weights waits until no call is in flight and holds new
  ones back meanwhile (writer first), so every completion is stamped with the version
  that really sampled it, and a multi-turn episode can see a new version between two
  turns but never inside one. For a server, waiting for every request in flight would
  make each new version wait for the slowest episode (the synchronous barrier async
  training removes), so loads only exclude each other; the server's own record of requests
  in flight (:mod:`producers.reload`) decides what happens to them during an update and
  stamps each token with the version that sampled it.
- :class:`AdmissionWaits`: rows waiting for an admission slot poll on their own back-off,
  but the first one a trainer step lets in wakes the others to ask at once, so the rows
  that fit go on together (and an in-process model samples them in one batch) rather than
  one by one over the next half second.
- :func:`blocking`: run a blocking call (Redis, a local model, httpx) in a worker thread;
  cancelling the caller (a rollout timeout) abandons the thread's result instead of
  waiting for it.
- :func:`retrying`: the async twin of ``streamer.connection.retrying`` for server outages.
- :func:`first_leaf`: what a task group's (nested) exception group really holds.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from streamer.connection import TRANSIENT

log = logging.getLogger(__name__)


class WeightGate:
    """A readers-writer gate: many sample calls, or one weight load."""

    def __init__(self, *, exclusive: bool = True):
        self.exclusive = exclusive
        self._cond = anyio.Condition()
        self._readers = 0
        self._writing = False

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        async with self._cond:
            while self._writing and self.exclusive:
                await self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self._readers -= 1
                    self._cond.notify_all()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        async with self._cond:
            while self._writing:
                await self._cond.wait()
            self._writing = True  # from here new readers wait
            try:
                while self._readers and self.exclusive:
                    await self._cond.wait()
            except BaseException:
                self._writing = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self._writing = False
                    self._cond.notify_all()


class AdmissionWaits:
    """Rows of one producer waiting for their admission slots (one event loop's)."""

    POLL, MAX_POLL = 0.05, 0.5  # seconds between a waiting row's asks: the first, at most

    def __init__(self):
        self._opened = anyio.Event()  # set when a row that waited got in: others ask now

    async def wait(self, try_admit, stop, *, poll: float = POLL) -> float | None:
        """Ask ``await try_admit()`` until it grants, ``poll`` seconds after the first ask and
        1.5 times longer each time after (at most MAX_POLL), or at once when another row got
        in; seconds waited, or None once ``stop()``."""
        start, delay = time.monotonic(), poll
        woken = False
        while not await try_admit():
            if stop():
                return None
            opened = self._opened
            woken = False
            with anyio.move_on_after(delay):
                await opened.wait()
                woken = True
            if not woken:
                delay = min(delay * 1.5, max(poll, self.MAX_POLL))
        if not woken:  # found the window open by itself: the others may fit too
            self._opened.set()
            self._opened = anyio.Event()
        return time.monotonic() - start


async def blocking(fn, /, *args, limiter: anyio.CapacityLimiter | None = None, **kwargs):
    """``fn(*args, **kwargs)`` in a worker thread; cancellation abandons it."""
    call = functools.partial(fn, *args, **kwargs)
    return await anyio.to_thread.run_sync(call, limiter=limiter, abandon_on_cancel=True)


async def retrying(fn, *, what: str):
    """Await ``fn()`` until the server answers, backing off to 5 s, logging each failure."""
    delay = 0.1
    while True:
        try:
            return await fn()
        except TRANSIENT as e:
            log.warning("%s: server unavailable (%s); retrying in %.1fs", what, e, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)


def first_leaf(e: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: what an episode really raised."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e
