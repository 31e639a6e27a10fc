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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from producers.dataset import Order
from producers.stats import Pending
from schemas import TrajectoryGroup, WeightSync, encode
from streamer import rows
from streamer.admission import NO_ROOM, Admission, Claim, Leases, Published
from streamer.bus import Publisher, unacked
from streamer.keys import Keys
from streamer.stamp import stamped
from streamer.tail import Tail
from streamer.values import parse_int

log = logging.getLogger(__name__)

WINDOW = 256  # tickets whose rows a claim is told, to pass over rows set aside


class Trips:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        leases: Leases,
        admission: Admission,
        order: Order,
        tail: Tail,
        pending: Pending,
        publisher: Publisher,
        source: str,
    ):
        self.client, self.keys, self.leases, self.admission = client, keys, leases, admission
        self.order, self.tail, self.pending, self.publisher, self.source = (
            order,
            tail,
            pending,
            publisher,
            source,
        )
        self.defers = leases.revisit_probability < 1  # rows that teach nothing step aside
        self.cursor = -1  # the ticket cursor the last claim saw: where the next window starts
        self.rows = rows.RowCounts(leases.n_rows, 0, 0)  # as the last reply said
        self.newest: WeightSync | None = None  # the newest policy, as the last claim said
        self.fresh = False  # ... and no engine call has used that news yet

    def claim(self) -> Claim:
        window = (-1, b"")
        if self.defers:
            if self.cursor < 0:  # the first claim: where the cursor stands
                self.cursor = parse_int(self.client.get(self.keys.cursor), self.keys.cursor, default=0)
            window = (self.cursor, self.order.window(self.cursor, WINDOW))
        claim = self.leases.claim_admit(self.admission, known_policy=self.tail.last_id, window=window)
        self.cursor = claim.cursor
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
        values_for: Callable[[float], dict[str, float]],
        *,
        stop: threading.Event,
        max_unacked: int,
    ) -> Published | str | None:
        """Publish ``group`` with its metrics event (``values_for(backpressure seconds)``):
        what was published, None (the lease was lost) or "stopped" (stopping, and no room:
        nothing published, the caller hands the row back)."""
        outcome, pass_rate = rows.outcome([s.reward for s in group.samples])
        row = (group.row, outcome, pass_rate) if outcome else None
        payload = encode(group)

        def once(room: int, waited: float) -> Published | str | None:
            pending = self.pending.drain()
            values = {**values_for(waited), **self.gauges()}
            values = {**values, **{k: values.get(k, 0.0) + v for k, v in pending.items()}}
            event = stamped(values=values, source=self.source)
            out = self.leases.publish(
                ticket, payload, max_unacked=room, metrics=event, group_version=group.policy_version, row=row
            )
            if out is None or out is NO_ROOM:  # the event was not sent: its counts wait for the next
                self.pending.restore(pending)
            return out

        published = once(max_unacked, 0.0)
        if published is NO_ROOM:
            waited = self.publisher.wait_for_room(stop.is_set)
            if stop.is_set() and unacked(self.client, self.keys.traj) >= max_unacked:
                return "stopped"
            published = once(-1, waited)
        if isinstance(published, Published) and published.corrupt_row is not None:
            log.warning(
                "row %s: its record on the server was unreadable; treated as new", published.corrupt_row
            )
        return published
