"""Row leases and admission slots: the one home of the invariant that every row is published
at most once, none is lost, and every admission slot is taken and given back exactly once.

**Leases.** A producer claims a *ticket* (see :class:`producers.dataset.Order`) in one Lua script:
first it sweeps leases that expired (their producer died or stalled) onto ``…:requeue``,
then takes the oldest requeued ticket, else ``INCR``s ``…:cursor``. The lease lives in
``…:leases`` (ZSET ticket -> expiry, server time) and ``…:lease_owner`` (HASH ticket ->
producer id); the holder renews it while it works.

Every later step checks ownership inside the same script that acts, so a producer whose
lease was swept cannot publish a row that someone else now holds:

- :meth:`Leases.publish` XADDs the group *and* drops the lease atomically (a crash before
  it leaves the row leased, to be re-issued; after it, the row is done);
- :meth:`Leases.finish` drops the lease without publishing (the group was dropped);
- :meth:`Leases.hand_back` requeues the ticket at the front (shutdown, sampler failure).

Admission slots are tied to leases as well: the producer's admission
(``Admission.try_admit(ticket, owner)``) records that a ticket holds a slot
(``keys.lease_slots``), in the script that takes it, and whoever ends a lease without
publishing (hand back, finish, or the sweep of a dead producer's lease) gives the slot
back, so a crashed producer cannot leak admission capacity. Publishing moves the slot to
the entry (``keys.held_slots``); the trainer gives it back (:meth:`Admission.release`).

A producer does the claim and its first admission try in one script
(:meth:`Leases.claim_admit`, which also passes over rows set aside, see
:mod:`streamer.rows`) and publishes with the room check and its metrics event in another
(:meth:`Leases.publish`): two round trips per row. The same rules, the same Lua text.

**Admission.** A group may start only while ``in_flight < (max_staleness + 1) * groups_per_step``, where
``in_flight`` (the counter ``…:admitted``) counts groups admitted and not yet trained or
released. This is AReaL's ``admitted < (max_staleness + version + 1) * groups_per_step``
with the trained groups (``version * groups_per_step`` of them) taken off both sides: the
same bound while the invariant holds, and it still holds where the invariant does not — a
restart that publishes the restored weights under a new version number, a resume with a
different ``groups_per_step``, a server that lost its data.

Every slot has an owner, and the counter moves only when an owner set changes:

- a row lease: ``…:lease_slots`` (ticket) — taken by :meth:`Admission.try_admit` with the
  ticket (``SADD`` == 1 then ``INCR``), given back when the lease ends unpublished;
- a published group: ``…:held_slots`` (trajectory entry id) — the slot moves there from the
  ticket in the script that publishes it (:meth:`Leases.publish`);
- :meth:`Admission.release` (:meth:`Admission.reject`) gives back the slots of entries the
  trainer trained, rejected or dead-lettered: ``SREM`` == 1 then ``DECR``, so a repeat, or
  an entry that never held a slot (published by hand, a fuzzer), changes nothing. The
  counter cannot go negative.

:meth:`Admission.reconcile` (trainer start) drops owners whose entries are gone or already
acknowledged and sets the counter to the owners' count, which also repairs a run whose
counter a bug, an operator or an older version left wrong.

The Lua scripts, and which keys each touches, are in :mod:`streamer.lease_scripts`. The
one Python twin of the admission rule is :func:`admission_limit`, which `streamer status` uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import redis

from streamer import lease_scripts as lua
from streamer.bus import FIELD, as_str
from streamer.connection import TRANSIENT
from streamer.errors import LeaseLost
from streamer.keys import TRAINER_GROUP, Keys
from streamer.rows import NEVER, Rule
from streamer.stamp import Stamped
from streamer.values import DataError, wrong_type

EXHAUSTED = -1  # every ticket of the configured epochs is claimed and no lease is open
WAIT = -2  # no ticket now, but open leases may still expire and be re-issued


class Admission:
    def __init__(
        self, client: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int, fence=None
    ):
        self.client, self.keys = client, keys
        self.fence = fence  # the trainer's lease: its releases and acks check its fencing token
        self.defaults = (max_staleness, groups_per_step)
        self._script = client.register_script(lua.ADMIT)
        self._release = client.register_script(lua.RELEASE)
        self._reconcile = client.register_script(lua.RECONCILE)

    def try_admit(self, ticket: int | None = None, owner: str = "") -> bool:
        """Take a slot if the rule allows; with ``ticket``, as that lease's (LeaseLost if gone).

        Without a ticket the slot has no owner to give it back (tests and benchmarks only).
        """
        keys, args = [self.keys.admitted, self.keys.limits], list(self.defaults)
        if ticket is not None:
            keys, args = keys + [self.keys.lease_owner, self.keys.lease_slots], args + [ticket, owner]
        try:
            granted = int(self._script(keys=keys, args=args))
        except TRANSIENT:  # a cluster that is down answers CLUSTERDOWN, a ResponseError too
            raise
        except redis.exceptions.ResponseError as e:  # not a number, or a key of another type
            raise DataError(f"admission: {wrong_type(self.client, self.keys.types(), e) or e}") from None
        if granted < 0:
            raise LeaseLost(f"the lease on ticket {ticket} is no longer {owner}'s")
        return granted > 0

    def release(self, entry_ids: Iterable[str], *, trained: bool = False) -> int:
        """Give back the slots these trajectory entries hold (each at most once, ever); with
        ``trained`` (a step trained them), also clear the rejections counted since the last
        step. Idempotent, so a retry after a lost reply is safe. Returns the slots given back."""
        return self._release_script("", [(i, "") for i in entry_ids], trained=trained)

    def reject(self, rejected: Iterable[tuple[str, str]], *, group: str) -> int:
        """(entry id, reason) pairs: acknowledge each for ``group``, count its reason (for
        `streamer status`) and give back its slot, atomically. A retry may count a reason
        twice; the slots and acks stay exact."""
        return self._release_script(group, list(rejected), trained=False)

    def _release_script(self, group: str, pairs: list[tuple[str, str]], *, trained: bool) -> int:
        if not pairs and not trained:
            return 0
        k = self.keys
        keys = [k.held_slots, k.admitted, k.traj, k.rejected_since_step]
        args = [group, "1" if trained else "0", *(x for pair in pairs for x in pair)]
        if self.fence is not None:
            keys, args = [*keys, self.fence.key], [*args, self.fence.token]
        released = int(self._release(keys=keys, args=args))
        if released < 0:
            raise self.fence.fenced()
        return released

    def reconcile(self, group: str) -> int:
        """Drop slots of entries that are gone or acknowledged by ``group``; recount. In flight."""
        k = self.keys
        return int(self._reconcile(keys=[k.held_slots, k.admitted, k.lease_slots, k.traj], args=[group]))

    def publish_limits(self, *, max_staleness: int, groups_per_step: int) -> None:
        self.client.hset(
            self.keys.limits,
            mapping={"max_staleness": max_staleness, "groups_per_step": groups_per_step},
        )

    def snapshot(self) -> dict[str, int]:
        admitted, version = self.client.mget(self.keys.admitted, self.keys.version)
        return {"admitted": int(admitted or 0), "version": int(version or 0)}


def admission_limit(max_staleness: int, groups_per_step: int) -> int:
    """Groups that may be in flight at once."""
    return (max_staleness + 1) * groups_per_step


class Published(NamedTuple):
    entry_id: str  # the group's trajectory entry
    rollout_step: int  # its step on the rollout axis (one per published group, run-wide)
    version: bytes | None  # the policy version key as the server held it (unparsed)
    corrupt_row: str | None = None  # the group's row, when its record was not one (now new)


NO_ROOM = "no room"  # publish: the trajectory stream holds max_unacked entries; nothing written


class Claim(NamedTuple):
    """The reply of :meth:`Leases.claim_admit`."""

    ticket: int  # >= 0 (leased to us), EXHAUSTED, WAIT, NOTHING_TO_TEACH or AGAIN
    granted: bool  # the ticket's admission slot was taken in the same step
    cursor: int  # the cursor after the claim: where the producer's next window of rows starts
    passed_over: int  # tickets of rows set aside that the claim passed over
    rows_solved: int  # rows set aside as solved / unsolvable (0 when rows are never set aside)
    rows_unsolvable: int
    policy_id: str | None  # the newest entry of the policy stream (None: it is empty)
    policy_fields: dict | None  # that entry's fields, unless it is the one the caller knew
    corrupt_rows: list[str]  # rows whose record was missing or not a record (now new)


NOTHING_TO_TEACH = -3  # every row is set aside, and a last look at each taught nothing (streamer/rows.py)
AGAIN = -4  # the cursor left the caller's window of rows: claim again with a new window


class Leases:
    """Claims, renews and ends row leases of one producer (``owner``)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        owner: str,
        lease_seconds: float,
        total_tickets: int | None = None,
        sweep_batch: int = 100,
        max_attempts: int = 0,
        rule: Rule = NEVER,
        n_rows: int = 0,
    ):
        self.client, self.keys, self.owner = client, keys, owner
        self.lease_seconds, self.total_tickets = lease_seconds, total_tickets
        self.sweep_batch = sweep_batch
        self.max_attempts = max_attempts  # failed attempts before a row is skipped; 0 = never
        self.rule = rule  # when rows that teach nothing step aside
        self.n_rows = n_rows  # the dataset's rows (for "nothing left to teach")
        self._claim = client.register_script(lua.CLAIM)
        self._claim_admit = client.register_script(lua.CLAIM_ADMIT)
        self._renew = client.register_script(lua.RENEW)
        self._publish = client.register_script(lua.PUBLISH)
        self._end = client.register_script(lua.END)
        self._forgive = client.register_script(lua.FORGIVE)

    def claim(self) -> int:
        """A ticket (>= 0) now leased to us, or :data:`EXHAUSTED` / :data:`WAIT`."""
        k = self.keys
        limit = -1 if self.total_tickets is None else self.total_tickets
        return int(
            self._claim(
                keys=[
                    *(k.cursor, k.leases, k.lease_owner, k.requeue, k.lease_slots, k.admitted),
                    *(k.row_attempts, k.row_errors, k.skipped_rows),
                ],
                args=[self.owner, self.lease_seconds, limit, self.sweep_batch, self.max_attempts],
            )
        )

    def renew(self, ticket: int) -> bool:
        """Push the lease's expiry out; False when it is no longer ours."""
        k = self.keys
        return bool(
            self._renew(keys=[k.leases, k.lease_owner], args=[ticket, self.owner, self.lease_seconds])
        )

    def claim_admit(
        self, admission: Admission, *, known_policy: str = "", window: tuple[int, bytes] = (-1, b"")
    ) -> Claim:
        """Claim a ticket and try its admission slot in one round trip (see :data:`Claim`).

        ``known_policy``: the policy entry id the caller has (its fields come back only when
        the newest is another). ``window``: (first ticket, the rows of the tickets from it as
        little-endian uint32), used to pass over rows set aside (see :mod:`streamer.rows`)."""
        k, (base, rows) = self.keys, window
        limit = -1 if self.total_tickets is None else self.total_tickets
        try:
            reply = self._claim_admit(
                keys=[
                    *(k.admitted, k.cursor, k.leases, k.lease_owner, k.requeue, k.lease_slots),
                    *(k.row_attempts, k.row_errors, k.skipped_rows, k.limits, k.policy),
                    *(k.rows, k.rows_solved, k.rows_unsolvable, k.last_look, k.row_credit),
                ],
                args=[
                    *(self.owner, self.lease_seconds, limit, self.sweep_batch, self.max_attempts),
                    *(*admission.defaults, known_policy, base, rows, *self.rule, self.n_rows),
                ],
            )
        except TRANSIENT:  # a cluster that is down answers CLUSTERDOWN, a ResponseError too
            raise
        except redis.exceptions.ResponseError as e:  # the cursor is not a number, a key of another type
            raise DataError(f"claiming a row: {wrong_type(self.client, k.types(), e) or e}") from None
        ticket, granted, cursor, passed, solved, unsolvable, policy_id, fields, *corrupt = reply
        if isinstance(granted, bytes):  # the lease is ours; the admission counters are broken
            self.hand_back(int(ticket))
            raise DataError(f"admission: {as_str(granted)}")
        return Claim(
            *(int(ticket), int(granted) > 0, int(cursor), int(passed), int(solved), int(unsolvable)),
            as_str(policy_id) if policy_id is not None else None,
            dict(zip(fields[::2], fields[1::2], strict=True)) if fields is not None else None,
            [as_str(r) for r in corrupt],
        )

    def publish(
        self,
        ticket: int,
        payload: bytes,
        *,
        max_unacked: int = -1,
        metrics: Stamped | None = None,
        group_version: int = 0,
        row: tuple[int, str, float] | None = None,
    ) -> Published | str | None:
        """XADD ``payload`` to the trajectory stream and end the lease, atomically.

        With ``max_unacked`` >= 0, only while the trainer group has fewer entries outstanding
        (else :data:`NO_ROOM`, nothing written). ``metrics``: the group's rollout event, sent
        in the same step with its rollout step and version offset against ``group_version``.
        ``row``: (row, outcome, pass rate) for the row's record (:mod:`streamer.rows`).
        Returns what was published, or None (nothing was) when the lease was lost.
        """
        k = self.keys
        row_args = ("", "", 0) if row is None else row
        event = metrics or ("", 0, 0)
        try:
            reply = self._publish(
                keys=[
                    *(k.traj, k.leases, k.lease_owner, k.lease_slots, k.held_slots),
                    *(k.row_attempts, k.row_errors, k.rollout_step, k.version, k.metrics),
                    *(k.rows, k.rows_solved, k.rows_unsolvable),
                ],
                args=[ticket, self.owner, FIELD, payload, max_unacked, TRAINER_GROUP, *event, group_version]
                + [*row_args, self.rule.solved_after, self.rule.failed_after, self.rule.pass_rate],
            )
        except TRANSIENT:
            raise
        except redis.exceptions.ResponseError as e:  # checked before anything is written
            raise DataError(f"publishing: {wrong_type(self.client, k.types(), e) or e}") from None
        if reply[0] == 0:
            return None
        if reply[0] == 2:
            return NO_ROOM
        _, entry, step, version, corrupt = reply
        return Published(as_str(entry), int(step), version, as_str(corrupt) if corrupt is not None else None)

    def finish(self, ticket: int) -> bool:
        """End the lease without publishing (the row is done for this epoch); frees its slot."""
        return self._end_lease(ticket, requeue=False)

    def hand_back(self, ticket: int, *, error: str = "") -> bool:
        """End the lease and requeue the ticket first in line; frees its slot.

        With ``error`` (the row's work failed) it counts as a failed attempt: after
        ``max_attempts`` of them the row is skipped instead of handed out again.
        """
        return self._end_lease(ticket, requeue=True, error=error)

    def forgive(self, tickets: Iterable[int]) -> int:
        """Forget the failed attempts of ``tickets`` (their failures were not theirs: every row
        failed the same way); one skipped for them is handed out again. Returns how many were
        skipped."""
        k = self.keys
        return int(
            self._forgive(
                keys=[k.row_attempts, k.row_errors, k.skipped_rows, k.requeue], args=sorted(set(tickets))
            )
        )

    def _end_lease(self, ticket: int, *, requeue: bool, error: str = "") -> bool:
        k = self.keys
        return bool(
            self._end(
                keys=[
                    k.leases,
                    k.lease_owner,
                    k.lease_slots,
                    k.admitted,
                    k.requeue,
                    k.row_attempts,
                    k.row_errors,
                ],
                args=[ticket, self.owner, int(requeue), error[:500]],
            )
        )
