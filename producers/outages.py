"""What a producer does when the engine, or something every row shares, is failing.

- At start-up (:meth:`Outages.wait_for_engine`) a remote engine is asked a first request
  until it answers: it may still be starting, or be down; meanwhile `status` names it. One
  that answers with an error (a model it refuses) stops the producer, with the engine's
  reason, before any row is claimed.
- Mid-run (:meth:`Outages.engine_failed`) an engine that cannot be reached (or answers 5xx)
  is an outage, waited out with backoff for as long as it lasts and named in `status`; one
  that refuses :data:`MAX_SAMPLER_FAILURES` rows in a row (4xx) is not going to serve this
  producer: it stops.
- A rollout that raised or timed out (:func:`rollout_failure`) failed for its row's sake,
  unless what it raised is the engine's or the server's failure: that is an outage.
- Rollouts failing the same way, numbers aside, on :data:`SYSTEMIC_ROWS` different rows with
  no success between (:meth:`Outages.shared`) fail for the engine's or the weights' sake, not
  the rows': the attempts they charged are forgiven (a row skipped for them is handed out
  again), none is charged after, the producer backs off and `status` says so.

A published group ends the outage (:meth:`Outages.recovered`) and clears what `status` said.
"""

from __future__ import annotations

import logging
import re
import threading

import anyio
import redis

from producers.inflight import first_leaf
from producers.samplers import SamplerError
from streamer import problems
from streamer.admission import Leases
from streamer.connection import TRANSIENT
from streamer.errors import EpisodeRejected, WeightsError
from streamer.keys import Keys
from streamer.rollout.contract import Task

log = logging.getLogger(__name__)

MAX_SAMPLER_FAILURES = 10  # rows in a row refused by the engine before the producer gives up
SYSTEMIC_ROWS = 3  # different rows failing the same way in a row: the engine's or the weights' fault


def rollout_failure(e: Exception, *, timeout: float) -> tuple[str, str]:
    """(reason, why) of a rollout that raised ``e``, reason one of
    :data:`producers.episodes.REASONS`; the engine's or the server's failure is raised again."""
    leaf = first_leaf(e)
    if isinstance(leaf, (SamplerError, WeightsError, *TRANSIENT)):
        raise leaf from e
    if isinstance(leaf, TimeoutError):
        return "timeout", f"timed out: {leaf}" if str(leaf) else f"timed out after {timeout:.1f}s"
    if isinstance(leaf, EpisodeRejected):  # e.g. a service's bad reply
        return leaf.reason, str(leaf)
    return "error", f"raised {type(leaf).__name__}: {leaf}"


class Outages:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        leases: Leases,
        *,
        stop: threading.Event,
        who: str,
    ):
        self.client, self.keys, self.leases, self.stop, self.who = client, keys, leases, stop, who
        self.failures = 0  # engine calls failed in a row
        self.streak: list[tuple[str, int, int]] = []  # (failure, ticket, row) failed since a success
        self.problem = False  # whether status's problems name this producer

    def report(self, what: str) -> None:
        problems.report(self.client, self.keys, self.who, what)
        self.problem = True

    def wait_for_engine(self, sampler, task: Task, *, log_every: float = 30.0) -> None:
        """A remote engine: ask it a first row's prompt until it answers (module docstring)."""
        probe = getattr(sampler, "probe", None)
        if probe is None:
            return
        prompt = task.renderer.render(task.rows[0]) if task.rows else [0]
        waited, last_log, delay = 0.0, -log_every, 0.5
        while not self.stop.is_set():
            try:
                probe(prompt)
            except SamplerError as e:
                if e.refused:
                    problems.report(self.client, self.keys, self.who, str(e))
                    raise
                if waited - last_log >= log_every:
                    log.warning("waiting for the engine (%.0fs so far): %s", waited, e)
                    last_log = waited
                self.report(f"engine unreachable: {e}")
                self.stop.wait(delay)
                waited += delay
                delay = min(5.0, delay * 2)
                continue
            self.recovered()
            log.info("engine %s answers", getattr(sampler, "base_url", ""))
            if (check := getattr(sampler, "check_updates", None)) is not None:
                try:
                    check()
                except SamplerError as e:
                    problems.report(self.client, self.keys, self.who, str(e))
                    raise
            return

    async def engine_failed(self, e: SamplerError) -> None:
        """Back off after a failed engine call (the row was handed back); raise the engine's
        refusal once :data:`MAX_SAMPLER_FAILURES` rows in a row were refused."""
        self.failures += 1
        if e.refused:
            log.error("the engine refused a request (%d in a row): %s; row handed back", self.failures, e)
            if self.failures >= MAX_SAMPLER_FAILURES:
                raise SamplerError(f"{self.failures} rows in a row were refused by the engine; last: {e}")
        else:
            log.error("engine unreachable (%d tries): %s; row handed back, waiting", self.failures, e)
            self.report(f"engine down: {e}")
        await self.backoff(min(30.0, 0.5 * 2 ** min(self.failures, 6)))

    def shared(self, why: str, ticket: int, row: int) -> float | None:
        """After a failed rollout: the seconds to back off when every row fails this way
        (logged and reported; the attempts it charged forgiven the first time it shows),
        None when the failure is the row's own."""
        key = re.sub(r"\d+", "#", why)[:200]
        if self.streak and self.streak[-1][0] != key:
            self.streak = []
        before = len({r for _, _, r in self.streak})
        self.streak = [*self.streak[-50:], (key, ticket, row)]
        if len({r for _, _, r in self.streak}) < SYSTEMIC_ROWS:
            return None
        if before < SYSTEMIC_ROWS:  # it shows now
            unskipped = self.leases.forgive(t for _, t, _ in self.streak)
            log.warning(
                "forgave the failed attempts of %d rows (%d had been skipped)", len(self.streak), unskipped
            )
        what = f"every row fails the same way ({len(self.streak)} rollouts in a row): rollout {why}"
        log.error("%s; not counted against the rows (engine or weights?), backing off", what)
        self.report(what)
        return min(30.0, 0.5 * 2 ** min(len(self.streak) - SYSTEMIC_ROWS, 6))

    def recovered(self) -> None:
        """A group was published: no failure is shared any more, and status says nothing."""
        self.streak.clear()
        if self.problem:
            problems.clear(self.client, self.keys, self.who)
            self.problem = False

    async def backoff(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            while not self.stop.is_set():
                await anyio.sleep(0.05)
