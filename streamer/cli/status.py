"""`streamer status`: one look at a run's streams, policy, producers and dead letters.

The numbers come from :func:`streamer.readmodel.snapshot` (the same read the metrics
exporter samples); this module renders them as a few short tables and sets the exit
status: 1 when the run looks stalled, so scripts and cron jobs can act on it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import msgspec

from streamer.config import RunConfig
from streamer.connection import connect, redact
from streamer.keys import Keys
from streamer.readmodel.health import Snapshot, age, checkpoint_names, snapshot, stall_reasons


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> list[str]:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def render(snap: Snapshot) -> str:
    """The human view: a few short tables, one screen."""
    p = snap.policy
    rate = "-" if snap.step_rate is None else f"{snap.step_rate:.3g} steps/s"
    lines = [f"run {snap.run} on {snap.redis_url}"]
    if p:
        lines.append(
            f"policy      version {p.version} (step {p.step}), {age(p.age_seconds)} ago; trainer {rate}"
        )
    else:
        lines.append("policy      no version published yet")
    if snap.steps_skipped:
        lines.append(
            f"skipped     {snap.steps_skipped} trainer steps changed no weights (gradient not finite); "
            "their groups are dead letters"
        )
    limit = "" if snap.admission_limit is None else f" of {snap.admission_limit}"
    lines.append(
        f"admission   {snap.admitted}{limit} slots held; {snap.waiting_groups} groups wait for the trainer"
    )
    lines.append("streams")
    rows = []
    for s in snap.streams:
        for i, g in enumerate(s.groups or [None]):
            head = (s.name, s.length, s.entries_added) if i == 0 else ("", "", "")
            rows.append((*head, *((g.name, g.lag, g.pending, g.consumers) if g else ("-", "", "", ""))))
    lines += _table(("STREAM", "LENGTH", "ADDED", "GROUP", "LAG", "PENDING", "CONSUMERS"), rows)
    if snap.rows_total:
        active = snap.rows_total - snap.rows_solved - snap.rows_unsolvable
        lines.append(
            f"rows        {active} active, {snap.rows_solved} solved, {snap.rows_unsolvable} unsolvable "
            f"(of {snap.rows_total}; solved and unsolvable rows are set aside)"
        )
    lines.append(f"producers   {snap.live_producers} live of {snap.known_producers} known")
    if snap.producers:
        lines += _table(
            ("PRODUCER", "LAST BEAT", "STATE"),
            [(q.id, f"{age(q.age_seconds)} ago", "live" if q.live else "gone") for q in snap.producers],
        )
    if snap.skipped_rows:
        lines.append(f"skipped rows {snap.skipped_rows} (each failed producer.max_row_attempts times)")
        lines += _table(("TICKET", "WHY"), [(t, why[:100]) for t, why in snap.skipped_last.items()])
    if snap.problems:
        lines.append("problems")
        lines += _table(("WHO", "WHAT"), [(who, what[:140]) for who, what in snap.problems.items()])
    lines.append(f"dead letters {snap.dead_letters}")
    if snap.dead_last:
        lines += _table(
            ("WHEN", "STREAM", "ENTRY", "REASON"),
            [(f"{age(snap.at - d.at)} ago", d.stream, d.entry_id, d.reason[:100]) for d in snap.dead_last],
        )
    if snap.stalled:
        lines.append("STALLED: " + "; ".join(snap.reasons))
    elif snap.nothing_to_teach:
        lines.append("status      done: nothing left to teach (every row is set aside)")
    elif snap.data_exhausted:
        what = (
            f"{snap.waiting_groups} groups still wait for the trainer"
            if snap.waiting_groups
            else "all trained"
        )
        lines.append(
            f"status      done: the data is exhausted (every row of producer.epochs is sampled; {what})"
        )
    else:
        lines.append("status      ok")
    return "\n".join(lines)


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Print the run's status; exit 1 when it looks stalled."""
    url = cfg.require_redis_url()
    client = connect(url, socket_timeout=cfg.bus.socket_timeout, name="streamer-status")
    keys = Keys(cfg.run.name)
    try:
        snap = snapshot(client, keys, redis_url=redact(url), stall_seconds=cfg.metrics.stall_seconds)
        if not client.exists(keys.run_marker) and (found := checkpoint_names(cfg.checkpoint_dir)):
            snap.data_lost = (
                f"checkpoint {found[0]} exists in {cfg.checkpoint_dir} but the server has no state for "
                "the run; start the trainer to resume from it (or restore the server's data first)"
            )
            snap.reasons = stall_reasons(snap, stall_seconds=cfg.metrics.stall_seconds)
            snap.stalled = True
    finally:
        client.close()
    if getattr(args, "json", False):
        print(msgspec.json.format(msgspec.json.encode(snap), indent=2).decode())
    else:
        print(render(snap))
    return 1 if snap.stalled else 0
