"""What a producer asks of the server per row, in two round trips.

1. **The claim** (:meth:`streamer.admission.Leases.claim_admit`): a ticket, its admission
   slot, the newest entry of the policy stream (in full only when it is new to us) and the
   count of rows set aside. The producer's next engine call takes the policy from this
   reply instead of reading the stream; a later call of the same row (a multi-turn
   rollout), or one after an admission wait, reads the stream itself.
2. **The publish** (:meth:`streamer.admission.Leases.publish`): the room check, the group,
   the row's record (:mod:`streamer.rows`) and the group's rollout metrics event
   (:mod:`streamer.stamp`). Only when the stream has no room does the producer wait
   (:meth:`streamer.bus.Publisher.wait_for_room`) and publish again.

Counts that happen between published groups (weight loads, dropped groups) wait in
:class:`~producers.stats.Pending` and ride along with the next group's metrics event, or go
out on their own (:meth:`Trips.flush_metrics`) when a group is dropped and when the
producer stops.
"""

from __future__ import annotations

import enum
import logging
import threading

import redis

from producers.dataset import Order
from producers.stats import Pending
from schemas import MetricsEvent, TrajectoryGroup, WeightSync, encode
from streamer import position, rows
from streamer.admission import AGAIN, NO_ROOM, Admission, Claim, Leases, Published
from streamer.bus import Publisher, unacked
from streamer.config import RunConfig
from streamer.connection import replicated
from streamer.keys import Keys
from streamer.stamp import stamped
from streamer.tail import Tail
from streamer.values import parse_int

log = logging.getLogger(__name__)

WINDOW = 256  # tickets whose rows a claim is told, to pass over rows set aside


class Outcome(enum.StrEnum):
    """What became of one claim."""

    PUBLISHED = "published"
    DROPPED = "dropped"  # fewer than min_group_size good episodes: nothing published
    FAILED = "failed"  # the rollout raised or timed out: the row was handed back
    ERROR = "error"  # the engine failed: the row was handed back, the producer backed off
    LOST = "lost"  # the lease expired before the group was published
    STOPPED = "stopped"  # stopping: the row was handed back
    WAIT = "wait"  # no row free now: leases held elsewhere may still expire
    AGAIN = "again"  # claim again, with a new window of rows
    EXHAUSTED = "exhausted"  # every epoch claimed and finished
    NOTHING_TO_TEACH = "nothing to teach"  # every row is set aside and a last look taught nothing
    FULL = "full"  # publish(wait=False): the stream had no room; nothing was published


class Trips:
    """Producer ``producer_id``'s leases, admission slots and publishes in run ``cfg``."""

    def __init__(
        self,
        cfg: RunConfig,
        client: redis.Redis,
        *,
        producer_id: str,
        order: Order,
        tail: Tail,
        pending: Pending,
    ):
        self.client, self.keys, self.order, self.tail, self.pending = (
            client,
            Keys(cfg.run.name),
            order,
            tail,
            pending,
        )
        p, t = cfg.producer, cfg.trainer
        self.leases = Leases(
            client,
            self.keys,
            owner=producer_id,
            lease_seconds=p.lease_seconds,
            total_tickets=order.total_tickets(p.epochs),
            max_attempts=p.max_row_attempts,
            rule=rows.Rule(p.defer_after, p.defer_failed_after, p.revisit_share, p.defer_pass_rate),
            n_rows=order.n_rows,
        )
        self.admission = Admission(
            client, self.keys, max_staleness=t.max_staleness, groups_per_step=t.groups_per_step
        )
        self.bus = cfg.bus
        self.publisher = Publisher(client, self.keys, cfg.bus)
        self.source = f"producer-{producer_id}"
        self.defers = self.leases.rule.on  # rows that teach nothing step aside
        self.cursor = -1  # the ticket cursor the last claim saw: where the next window starts
        self.cursor_high = 0  # the furthest cursor any claim saw: the cursor never goes back
        self.rows = rows.RowCounts(order.n_rows, 0, 0)  # as the last reply said
        self.newest: WeightSync | None = None  # the newest policy, as the last claim said
        self.fresh = False  # ... and no engine call has used that news yet
        self.told_nothing_to_teach = False

    def claim(self) -> Claim:
        window = (-1, b"")
        if self.defers:
            if self.cursor < 0:  # the first claim: where the cursor stands
                self.cursor = parse_int(self.client.get(self.keys.cursor), self.keys.cursor, default=0)
            window = (self.cursor, self.order.window(self.cursor, WINDOW))
        floor = self.cursor_high  # the server's cursor was at least this when the claim was sent
        claim = self.leases.claim_admit(self.admission, known_policy=self.tail.last_id, window=window)
        if claim.cursor < floor:  # (claims of other rows in flight may answer in any order)
            claim = self._cursor_went_back(claim, floor)
        self.cursor = claim.cursor
        self.cursor_high = max(self.cursor_high, claim.cursor)
        if claim.policy_fields is not None:
            self.newest = self.tail.take(claim.policy_id, claim.policy_fields)
        elif claim.policy_id is None:
            self.newest = None
        self.fresh = True
        self.rows = self.rows._replace(solved=claim.rows_solved, unsolvable=claim.rows_unsolvable)
        self.pending.add("rows_passed_over", claim.passed_over)
        for row in claim.corrupt_rows:
            log.warning("row %s: its record on the server was missing or unreadable; treated as new", row)
        return claim

    def _cursor_went_back(self, claim: Claim, floor: int) -> Claim:
        """The cursor is behind one this producer saw (deleted or overwritten): the tickets
        from it were handed out before, so their rows would be sampled and trained twice. Put
        it forward again; a new ticket this claim took from it ends unworked."""
        log.warning(
            "the dataset cursor %s went back from %d to %d (deleted or overwritten): put forward again; "
            "rows from it were handed out already",
            self.keys.cursor,
            floor,
            claim.cursor,
        )
        position.restore(self.client, self.keys, position.DataPosition(cursor=self.cursor_high))
        if claim.ticket >= 0 and claim.ticket == claim.cursor - 1:  # new, not a requeued one
            self.leases.finish(claim.ticket)
            return claim._replace(ticket=AGAIN, cursor=self.cursor_high)
        return claim._replace(cursor=self.cursor_high)

    def policy_news(self) -> tuple[bool, WeightSync | None]:
        """(True, the newest policy) once after each claim; (False, None) when it must be read."""
        fresh, self.fresh = self.fresh, False
        return fresh, self.newest if fresh else None

    def read_policy(self) -> WeightSync | None:
        self.newest = self.tail.latest()
        return self.newest

    def gauges(self) -> dict[str, float]:
        if not self.defers:
            return {}
        r = self.rows
        return {
            "rows_active": float(r.active),
            "rows_solved": float(r.solved),
            "rows_unsolvable": float(r.unsolvable),
        }

    def publish(
        self,
        ticket: int,
        group: TrajectoryGroup,
        values: dict[str, float],
        *,
        stop: threading.Event,
        wait: bool = True,
    ) -> Outcome:
        """Publish ``group`` with its metrics event (``values``, with the seconds waited for
        room as ``backpressure_wait_seconds``): PUBLISHED (with ``bus.min_replicas``: on that
        many replicas), LOST (the lease was) or STOPPED (stopping, and no room: nothing
        published, the caller hands the row back). Without ``wait``, FULL instead of waiting
        for room (nothing published: call again with it); see :attr:`may_block`."""
        outcome, pass_rate = rows.outcome([s.reward for s in group.samples])
        row = (group.row, outcome, pass_rate) if outcome else None
        payload = encode(group)

        def once(room: int, waited: float) -> Published | None:
            pending = self.pending.drain()
            waits = {"backpressure_wait_seconds": waited}
            event = stamped(values=_plus({**values, **waits, **self.gauges()}, pending), source=self.source)
            out = self.leases.publish(
                ticket, payload, max_unacked=room, metrics=event, group_version=group.policy_version, row=row
            )
            if out is None or out is NO_ROOM:  # the event was not sent: its counts wait for the next
                self.pending.restore(pending)
            return out

        published = once(self.bus.max_unacked, 0.0)
        if published is NO_ROOM and not wait:
            return Outcome.FULL
        if published is NO_ROOM:
            waited = self.publisher.wait_for_room(stop.is_set)
            if stop.is_set() and unacked(self.client, self.keys.traj) >= self.bus.max_unacked:
                return Outcome.STOPPED
            published = once(-1, waited)
        if published is None:
            log.warning("lease on row %d (epoch %d) was lost; group discarded", group.row, group.epoch)
            return Outcome.LOST
        if published.corrupt_row is not None:
            log.warning(
                "row %s: its record on the server was unreadable; treated as new", published.corrupt_row
            )
        # if the master dies before its replicas hold the group, the error redoes the step (the
        # row comes back when its lease expires, if the group is gone)
        replicated(self.client, self.keys.replicated, self.bus)
        return Outcome.PUBLISHED

    @property
    def may_block(self) -> bool:
        """Whether even a :meth:`publish` that finds room may wait (for ``bus.min_replicas``
        replicas to hold it)."""
        return self.bus.min_replicas > 0

    def send_metrics(self, values: dict[str, float]) -> None:
        """A rollout metrics event with ``values`` and what is pending, at the current rollout
        step (not a new one)."""
        step = parse_int(self.client.get(self.keys.rollout_step), self.keys.rollout_step, default=0)
        values = _plus(values, self.pending.drain())
        self.publisher.publish(
            self.keys.metrics, MetricsEvent(axis="rollout", step=step, values=values, source=self.source)
        )

    def flush_metrics(self) -> None:
        """Publish pending counters now."""
        if not self.pending:
            return
        try:
            self.send_metrics({})
        except redis.exceptions.RedisError as e:
            log.warning("could not publish pending rollout counters: %s", e)

    def exhausted(self) -> None:
        """Every ticket of the configured epochs is claimed and finished: say so on the server
        (for `streamer status` and `up`) at the cursor the last claim saw."""
        rows.exhausted(self.client, self.keys, self.cursor)

    def nothing_to_teach(self) -> bool:
        """Nothing is left to teach: say so in a metric, once; True that once."""
        if self.told_nothing_to_teach:
            return False
        self.told_nothing_to_teach = True
        self.send_metrics({"nothing_to_teach": 1.0, **self.gauges()})
        return True


def _plus(values: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """``values`` with ``counts`` added (a counter in both is summed)."""
    return {**values, **{k: values.get(k, 0.0) + v for k, v in counts.items()}}
