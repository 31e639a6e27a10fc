"""Every Redis key of a run, in one place. All live under ``streamer:{run}:``.

The braces are a Redis Cluster hash tag: every key of a run hashes to one slot, so each Lua
script and MULTI of a run touches one node, on a single server and on a cluster alike.
"""

from __future__ import annotations

import re

# a plain file name: it is also the run's directory under the data dir, so never ".", "..",
# a path or a hidden name (it starts with a letter or digit); "\Z", not "$": no trailing newline
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")

# consumer groups
TRAINER_GROUP = "trainer"
METRICS_GROUP = "metrics"  # the exporter's group on the metrics stream
ARCHIVE_GROUP = "archive"  # the rollout archiver on traj; trimming passes it past archive.max_lag
TRACKING_GROUP = "tracking"  # the tracker on metrics; the exporter's trim passes it past tracking.max_lag


class Keys:
    """Names of the streams and counters of one run."""

    def __init__(self, run: str):
        if not _RUN_RE.match(run):
            raise ValueError(
                f"run name {run!r} must be a plain name: 1-64 letters, digits, '_', '.', '-', "
                "starting with a letter or digit"
            )
        self.run = run
        self.prefix = f"streamer:{{{run}}}"  # hash tag: one cluster slot per run

    def _k(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    # streams
    @property
    def traj(self) -> str:
        return self._k("traj")  # TrajectoryGroup, read by group "trainer"

    @property
    def policy(self) -> str:
        return self._k("policy")  # WeightSync, read with plain XREAD

    @property
    def metrics(self) -> str:
        return self._k("metrics")  # MetricsEvent, read by groups "metrics" and "tracking"

    @property
    def dead(self) -> str:
        return self._k("dead")  # DeadLetter

    @property
    def metrics_snapshot(self) -> str:
        return self._k("metrics_snapshot")  # STRING: the exporter's msgspec state snapshot

    # counters and sets
    @property
    def cursor(self) -> str:
        return self._k("cursor")  # INCR: next global row ticket

    @property
    def leases(self) -> str:
        return self._k("leases")  # ZSET ticket -> lease expiry (unix seconds)

    @property
    def lease_owner(self) -> str:
        return self._k("lease_owner")  # HASH ticket -> producer id

    @property
    def lease_slots(self) -> str:
        return self._k("lease_slots")  # SET of tickets that hold an admission slot

    @property
    def held_slots(self) -> str:
        return self._k("held_slots")  # SET of trajectory entry ids whose group holds an admission slot

    @property
    def row_attempts(self) -> str:
        return self._k("row_attempts")  # HASH ticket -> failed attempts (crash, sampler error, expiry)

    @property
    def row_errors(self) -> str:
        return self._k("row_errors")  # HASH ticket -> the last error of a failed attempt

    @property
    def skipped_rows(self) -> str:
        return self._k("skipped_rows")  # HASH ticket -> why it was skipped after max_row_attempts

    @property
    def requeue(self) -> str:
        return self._k("requeue")  # LIST of tickets whose lease expired, handed out first

    @property
    def rows(self) -> str:
        return self._k("rows")  # HASH row -> its record "g,s,p" (streamer/rows.py)

    @property
    def rows_solved(self) -> str:
        return self._k("rows_solved")  # SET of rows set aside as solved

    @property
    def rows_unsolvable(self) -> str:
        return self._k("rows_unsolvable")  # SET of rows set aside as unsolvable

    @property
    def row_credit(self) -> str:
        return self._k("row_credit")  # FLOAT: revisits of rows set aside that are due

    @property
    def last_look(self) -> str:
        return self._k("last_look")  # INT: the ticket the last look at every (solved) row ends at

    @property
    def rows_settings(self) -> str:
        return self._k("rows_settings")  # STRING: JSON of the settings the row records were made under

    @property
    def data_end(self) -> str:
        # INT: the cursor at which a producer found every ticket of its epochs claimed and
        # finished; the data is exhausted while the cursor still equals it (streamer/rows.py)
        return self._k("data_end")

    @property
    def row_count(self) -> str:
        return self._k("row_count")  # INT: the dataset's rows, written by producers at start

    @property
    def admitted(self) -> str:
        return self._k("admitted")  # groups in flight: admitted, not yet trained or released

    @property
    def version(self) -> str:
        return self._k("version")  # current policy version (mirrors the policy stream)

    @property
    def limits(self) -> str:
        return self._k("limits")  # HASH max_staleness, groups_per_step (written by the trainer)

    @property
    def rollout_step(self) -> str:
        return self._k("rollout_step")  # INCR per published group: the rollout step axis

    @property
    def producers(self) -> str:
        return self._k("producers")  # ZSET producer id -> last heartbeat (unix seconds)

    @property
    def problems(self) -> str:
        return self._k(
            "problems"
        )  # HASH role -> JSON {at, what}: what it cannot do now (streamer/problems.py)

    # one shared inference server (producers that share `producer.remote_url`)
    def served(self, server: str) -> str:
        return self._k(f"served:{server}")  # INT: the newest version the server confirmed loading

    def reload_lock(self, server: str) -> str:
        return self._k(f"reload_lock:{server}")  # STRING (PX): token of the one producer reloading it

    def engine_readers(self, server: str) -> str:
        return self._k(f"engine_readers:{server}")  # ZSET request id -> lease end (ms): requests in flight

    def engine_update(self, server: str) -> str:
        return self._k(f"engine_update:{server}")  # STRING (PX) "mode:state:version": an update under way

    def engine_acks(self, server: str) -> str:
        return self._k(f"engine_acks:{server}")  # SET request ids that counted their tokens (keep)

    @property
    def rejected_since_step(self) -> str:
        return self._k("rejected_since_step")  # HASH reason -> groups rejected since the last step

    @property
    def replicated(self) -> str:
        return self._k("replicated")  # INT: written (INCR) just before a WAIT, see connection.replicated

    @property
    def trainer_lease(self) -> str:
        return self._k("trainer_lease")  # HASH owner fence holder, expiring: who trains the run

    @property
    def trainer_fence(self) -> str:
        return self._k("trainer_fence")  # INCR per lease taken: checked by every ack and version write

    @property
    def replayed(self) -> str:
        return self._k("replayed")  # HASH dead-letter id -> the entry id it was re-published as

    @property
    def run_marker(self) -> str:
        # HASH created_at trainer checkpoint (the newest one's name) [data_lost_at resumed_from];
        # gone = data lost
        return self._k("run")

    def types(self) -> dict[str, str]:
        """Every fixed key of the run and its Redis type (as TYPE names it), for the roles'
        start-up check: a key of another type is one clear line, not a WRONGTYPE later."""
        kinds = {
            "stream": (self.traj, self.policy, self.metrics, self.dead),
            "string": (
                self.metrics_snapshot,
                *(self.cursor, self.admitted, self.version, self.rollout_step),
                *(self.replicated, self.trainer_fence, self.row_count, self.last_look, self.row_credit),
                self.data_end,
                self.rows_settings,
            ),
            "hash": (
                *(self.lease_owner, self.row_attempts, self.row_errors, self.skipped_rows),
                *(self.limits, self.rejected_since_step, self.run_marker, self.replayed, self.trainer_lease),
                *(self.rows, self.problems),
            ),
            "set": (self.lease_slots, self.held_slots, self.rows_solved, self.rows_unsolvable),
            "zset": (self.leases, self.producers),
            "list": (self.requeue,),
        }
        return {key: kind for kind, names in kinds.items() for key in names}

    def all_keys_pattern(self) -> str:
        return f"{self.prefix}:*"
