"""A run's health as the server holds it: streams, policy, producers, rows, dead letters.

:func:`snapshot` reads everything in one pipelined round trip (plus one per consumer
group whose lag the server cannot report). `streamer status` renders it and the metrics
exporter samples it, so the table and the Prometheus series never disagree. Every read
is a named query in :data:`QUERIES` (the key it reads and the command), and the snapshot
is assembled from the replies by name.

A run is *stalled* when trajectory groups wait for the trainer (its group's lag plus
pending is above zero) and no new policy version has appeared for
``metrics.stall_seconds`` (measured from the newest ``WeightSync``, or from the first
trajectory entry when there is none yet). A finished run whose trainer stopped with
groups still queued also reads as stalled: nothing consumes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import redis

from schemas import DeadLetter, DecodeError, WeightSync
from streamer import problems
from streamer.admission import admission_limit
from streamer.bus import as_str, entry_event, group_lag
from streamer.connection import TRANSIENT
from streamer.keys import TRAINER_GROUP, Keys
from streamer.rows import from_replies
from streamer.values import DataError, parse_int, wrong_type


def checkpoint_names(root) -> list[str]:
    """Checkpoint directory names under ``root``, newest first (no torch import: status is light)."""
    from pathlib import Path

    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


LIVE_SECONDS = 15.0  # a producer whose last heartbeat is newer than this is live
RATE_WINDOW = 10  # policy versions the trainer step rate is measured over
SHOWN_PRODUCERS = 50  # newest heartbeats listed (the live count covers all of them)
SHOWN_SKIPPED = 3  # skipped rows listed by ticket (all are counted)


class GroupInfo(msgspec.Struct, kw_only=True):
    name: str
    consumers: int
    pending: int  # delivered, not acknowledged
    lag: int  # never delivered
    entries_read: int | None  # server counter (7.0+); None when unknown


class StreamInfo(msgspec.Struct, kw_only=True):
    name: str  # short name: traj, policy, metrics, dead
    key: str
    length: int
    entries_added: int  # every XADD ever, trimmed or not (server counter)
    last_entry_at: float | None  # unix time from the newest entry id
    first_entry_at: float | None
    groups: list[GroupInfo]


class PolicyInfo(msgspec.Struct, kw_only=True):
    version: int
    step: int
    at: float
    age_seconds: float
    uri: str


class ProducerInfo(msgspec.Struct, kw_only=True):
    id: str
    last_beat: float
    age_seconds: float
    live: bool


class DeadEntry(msgspec.Struct, kw_only=True):
    at: float
    stream: str
    entry_id: str
    consumer: str
    reason: str


class Snapshot(msgspec.Struct, kw_only=True):
    run: str
    redis_url: str  # password redacted
    at: float
    streams: list[StreamInfo]
    policy: PolicyInfo | None
    step_rate: float | None  # trainer steps per second over the last versions
    live_producers: int
    known_producers: int
    producers: list[ProducerInfo]  # newest heartbeats first
    dead_letters: int  # total ever written
    dead_last: list[DeadEntry]  # newest first
    admitted: int  # admission slots held (groups admitted and not released)
    limits: dict[str, int]  # as written by the trainer: max_staleness, groups_per_step
    admission_limit: int | None  # (max_staleness + 1) * groups_per_step groups in flight, as admission checks
    waiting_groups: int  # trajectory entries the trainer group has not acknowledged
    rejected_since_step: dict[str, int] = {}  # groups the trainer rejected since its last step
    trainer_state: str = ""  # "running" / "stopped" as the trainer wrote it; "" unknown
    steps_skipped: int = 0  # trainer steps that changed no weights (every update's gradient not finite)
    skipped_rows: int = 0  # rows skipped after producer.max_row_attempts failed attempts
    skipped_last: dict[str, str] = {}  # a few of them: ticket -> why
    problems: dict[str, str] = {}  # role -> what it cannot do, as it reported it (streamer/problems.py)
    rows_total: int = 0  # dataset rows, as the producers said (0: unknown)
    rows_solved: int = 0  # rows set aside: their last groups were all solved (streamer/rows.py)
    rows_unsolvable: int = 0  # rows set aside: their last groups taught nothing, most failed
    nothing_to_teach: bool = False  # every row set aside, a last look taught nothing: the producers stopped
    data_exhausted: bool = False  # every ticket of the producers' epochs claimed and finished
    data_lost: str = ""  # set when the server lost this run's data (see main)
    stalled: bool = False
    reasons: list[str] = []

    def stream(self, name: str) -> StreamInfo:
        return next(s for s in self.streams if s.name == name)


class Query(NamedTuple):
    key: str  # the Keys attribute it reads
    command: str  # the redis-py command
    args: Callable[[float, int], dict] = lambda now, dead_last: {}  # keyword arguments


STREAMS = ("traj", "policy", "metrics", "dead")  # short names, each also a Keys attribute

QUERIES: dict[str, Query] = {
    **{f"{s}_info": Query(s, "xinfo_stream") for s in STREAMS},
    **{f"{s}_groups": Query(s, "xinfo_groups") for s in STREAMS},
    "syncs": Query("policy", "xrevrange", lambda now, n: {"count": RATE_WINDOW}),
    "beats": Query(
        "producers", "zrevrange", lambda now, n: {"start": 0, "end": SHOWN_PRODUCERS - 1, "withscores": True}
    ),
    "live": Query("producers", "zcount", lambda now, n: {"min": now - LIVE_SECONDS, "max": "+inf"}),
    "known": Query("producers", "zcard"),
    "dead_rows": Query("dead", "xrevrange", lambda now, n: {"count": n}),
    "admitted": Query("admitted", "get"),
    "limits": Query("limits", "hgetall"),
    "version": Query("version", "get"),
    "rejected": Query("rejected_since_step", "hgetall"),
    "marker": Query("run_marker", "hgetall"),
    "skipped": Query("skipped_rows", "hlen"),
    "skipped_some": Query("skipped_rows", "hscan", lambda now, n: {"count": SHOWN_SKIPPED}),
    "problems": Query("problems", "hgetall"),
    "row_count": Query("row_count", "get"),
    "last_look": Query("last_look", "get"),
    "cursor": Query("cursor", "get"),
    "solved": Query("rows_solved", "scard"),
    "unsolvable": Query("rows_unsolvable", "scard"),
    "leases": Query("leases", "zcard"),
    "data_end": Query("data_end", "get"),
    "requeued": Query("requeue", "llen"),
}


def read(client: redis.Redis, keys: Keys, *, now: float, dead_last: int = 5) -> dict:
    """Every query's reply by name, in one round trip; a key that cannot be read is named,
    with the type it holds and the type the run keeps there."""
    pipe = client.pipeline(transaction=False)
    for q in QUERIES.values():
        getattr(pipe, q.command)(getattr(keys, q.key), **q.args(now, dead_last))
    replies = dict(zip(QUERIES, pipe.execute(raise_on_error=False)))
    for name, r in replies.items():
        if isinstance(r, TRANSIENT):  # the server (a cluster) is down, not the key bad
            raise r
        if isinstance(r, Exception) and not _missing(r):
            key = getattr(keys, QUERIES[name].key)
            raise wrong_type(client, {key: keys.types()[key]}, r) or DataError(
                f"{key} cannot be read ({r}); fix or delete it (`DEL {key}`)"
            )
    return replies


def snapshot(
    client: redis.Redis,
    keys: Keys,
    *,
    redis_url: str = "",
    now: float | None = None,
    stall_seconds: float = 300.0,
    dead_last: int = 5,
) -> Snapshot:
    """Read the run's health from the server; ``stalled``/``reasons`` filled in."""
    now = time.time() if now is None else now
    r = read(client, keys, now=now, dead_last=dead_last)
    streams = [
        _stream(client, name, getattr(keys, name), r[f"{name}_info"], r[f"{name}_groups"]) for name in STREAMS
    ]
    counts = from_replies(
        r["row_count"],
        r["last_look"],
        r["cursor"],
        r["solved"],
        r["unsolvable"],
        r["leases"],
        r["data_end"],
        r["requeued"],
    )
    parse_int(r["version"], keys.version, default=0)  # not shown, but a bad one is named here too
    limits = {as_str(k): parse_int(v, f"{keys.limits} {as_str(k)}") for k, v in r["limits"].items()}
    marker = {as_str(k): as_str(v) for k, v in r["marker"].items()}
    syncs = _decode_rows(r["syncs"], WeightSync)
    snap = Snapshot(
        run=keys.run,
        redis_url=redis_url,
        at=now,
        streams=streams,
        policy=_policy(syncs[0], now) if syncs else None,
        step_rate=_step_rate(syncs),
        live_producers=int(r["live"]),
        known_producers=int(r["known"]),
        producers=[
            ProducerInfo(
                id=as_str(m), last_beat=float(t), age_seconds=max(0.0, now - t), live=now - t <= LIVE_SECONDS
            )
            for m, t in r["beats"]
        ],
        dead_letters=streams[3].entries_added,
        dead_last=[_dead(d) for d in _decode_rows(r["dead_rows"], DeadLetter)],
        admitted=parse_int(r["admitted"], keys.admitted, default=0),
        limits=limits,
        admission_limit=_admission_limit(limits),
        waiting_groups=_waiting(streams[0]),
        rejected_since_step={
            as_str(k): parse_int(v, keys.rejected_since_step) for k, v in r["rejected"].items()
        },
        trainer_state=marker.get("trainer", ""),
        steps_skipped=parse_int(marker.get("steps_skipped"), f"{keys.run_marker} steps_skipped", default=0),
        skipped_rows=int(r["skipped"] or 0),
        skipped_last={as_str(k): as_str(v) for k, v in list(r["skipped_some"][1].items())[:SHOWN_SKIPPED]},
        problems={
            who: f"{p.what} ({age(max(0.0, now - p.at))} ago)"
            for who, p in sorted(problems.parse(r["problems"]).items())
        },
        rows_total=counts.total,
        rows_solved=counts.solved,
        rows_unsolvable=counts.unsolvable,
        nothing_to_teach=counts.nothing_to_teach,
        data_exhausted=counts.exhausted,
    )
    snap.reasons = stall_reasons(snap, stall_seconds=stall_seconds)
    snap.stalled = bool(snap.reasons)
    return snap


def stall_reasons(snap: Snapshot, *, stall_seconds: float) -> list[str]:
    """Why the run is not progressing (empty: it is, or it is idle by design)."""
    out = [f"the server lost this run's data: {snap.data_lost}"] if snap.data_lost else []
    out += [f"{who}: {what}" for who, what in snap.problems.items()]  # a role says it cannot work
    since = snap.policy.at if snap.policy else snap.stream("traj").first_entry_at
    if snap.nothing_to_teach or snap.data_exhausted:  # done by design: no new version is coming
        return out
    if since is None or snap.at - since <= stall_seconds:
        return out
    what = f"policy version {snap.policy.version}" if snap.policy else "a first policy version"
    head = f"no new policy version for {age(snap.at - since)} (last: {what})"
    if snap.waiting_groups:
        out.append(
            f"{head} while {snap.waiting_groups} trajectory groups wait for the trainer "
            f"(stall_seconds={stall_seconds:g})"
        )
    if rejected := snap.rejected_since_step:
        why = ", ".join(f"{r} {n}" for r, n in sorted(rejected.items(), key=lambda x: -x[1]))
        out.append(f"{head}: all {sum(rejected.values())} groups since were rejected ({why})")
    if snap.trainer_state != "running":
        return out
    full = snap.admission_limit is not None and snap.admitted >= snap.admission_limit
    if full and not snap.waiting_groups:
        out.append(
            f"{head}: the admission window is full ({snap.admitted} of {snap.admission_limit} slots) "
            "and no group waits for the trainer (slots held by rows still being sampled)"
        )
    if not snap.live_producers and not snap.waiting_groups:
        out.append(f"{head}: no live producers ({snap.known_producers} known)")
    return out


def _stream(client: redis.Redis, name: str, key: str, info, groups) -> StreamInfo:
    if isinstance(info, Exception):  # no such key
        info, groups = {}, []
    if isinstance(groups, Exception):
        groups = []
    last, first = info.get("last-entry"), info.get("first-entry")
    return StreamInfo(
        name=name,
        key=key,
        length=int(info.get("length", 0)),
        entries_added=int(info.get("entries-added", info.get("length", 0))),
        last_entry_at=_id_time(last[0]) if last else None,
        first_entry_at=_id_time(first[0]) if first else None,
        groups=[_group(client, key, g) for g in groups],
    )


def _group(client: redis.Redis, key: str, g: dict) -> GroupInfo:
    read = g.get("entries-read")
    return GroupInfo(
        name=as_str(g["name"]),
        consumers=int(g["consumers"]),
        pending=int(g["pending"]),
        lag=group_lag(client, key, g),
        entries_read=None if read is None else int(read),
    )


def _admission_limit(limits: dict[str, int]) -> int | None:
    if not {"max_staleness", "groups_per_step"} <= limits.keys():
        return None  # no trainer has published its limits yet
    return admission_limit(limits["max_staleness"], limits["groups_per_step"])


def _waiting(traj: StreamInfo) -> int:
    for g in traj.groups:
        if g.name == TRAINER_GROUP:
            return g.pending + g.lag
    return traj.length  # no trainer has joined yet: everything waits


def _policy(sync: WeightSync, now: float) -> PolicyInfo:
    return PolicyInfo(
        version=sync.version,
        step=sync.step,
        at=sync.at,
        age_seconds=max(0.0, now - sync.at),
        uri=sync.uri,
    )


def _step_rate(syncs: Sequence[WeightSync]) -> float | None:
    """Steps per second between the oldest and newest of the recent versions (newest first)."""
    if len(syncs) < 2:
        return None
    steps, seconds = syncs[0].step - syncs[-1].step, syncs[0].at - syncs[-1].at
    return steps / seconds if seconds > 0 and steps >= 0 else None


def _dead(d: DeadLetter) -> DeadEntry:
    stream = d.stream.rpartition(":")[2] or d.stream
    return DeadEntry(at=d.at, stream=stream, entry_id=d.entry_id, consumer=d.consumer, reason=d.reason)


def _decode_rows(rows, as_type) -> list:
    out = []
    for _, fields in rows if isinstance(rows, list) else []:
        try:
            out.append(entry_event(fields, as_type))
        except DecodeError:
            continue  # status reports what it can read; the bus dead-letters the rest
    return out


def _missing(e: Exception) -> bool:
    return isinstance(e, redis.exceptions.ResponseError) and "no such key" in str(e).lower()


def _id_time(entry_id) -> float:
    return int(as_str(entry_id).partition("-")[0]) / 1000.0


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
