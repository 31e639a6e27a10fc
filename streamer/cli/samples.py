"""`streamer samples` and `streamer dead`: what the model wrote, and what nobody could use.

``samples`` reads the rollout archive (:mod:`consumers.archive`) of a run from disk and
prints recent groups as text: prompt, then each completion with its reward, advantage and
version. ``--min-reward R`` keeps completions with reward >= R; ``--follow`` keeps printing
groups as the archiver writes them. ``dead`` lists the run's dead letters with their
reasons, and ``--replay ID`` re-publishes one (named by its full id) to the stream it came
from, after a fix: once, however often it is asked.
A run that does not exist is one line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import re
import sys
import time
import zlib
from datetime import datetime
from pathlib import Path

from consumers.archive import PATTERN, archive_dir
from consumers.sample_tables import ArchiveTail
from schemas import DeadLetter, DecodeError
from streamer.bus import FIELD, as_str, entry_event
from streamer.config import RunConfig
from streamer.connection import connect, redact
from streamer.keys import Keys

log = logging.getLogger(__name__)

FOLLOW_POLL = 1.0
ENTRY_ID = re.compile(r"^\d+-\d+\Z")
# KEYS: replayed, the stream it came from, dead ; ARGV: dead-letter id, field, payload.
# Re-publishes at most once per dead letter, whoever runs it how often: {1, new id} done now,
# {0, new id} done before, {-1, ''} no such dead letter.
REPLAY = """
local before = redis.call('HGET', KEYS[1], ARGV[1])
if before then return {0, before} end
if #redis.call('XRANGE', KEYS[3], ARGV[1], ARGV[1]) == 0 then return {-1, ''} end
local id = redis.call('XADD', KEYS[2], '*', ARGV[2], ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], id)
return {1, id}
"""


def file_records(path: Path) -> list[dict]:
    """The records of an archive file the archiver has moved past: its complete JSON lines,
    up to a corrupt or cut-off end if it has one."""
    out = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    except (EOFError, zlib.error, OSError) as e:  # the lines before it still count
        log.warning("cannot read archive file %s (%s): skipping the rest of it", path.name, e)
    return out


def _adv(value: float | None) -> str:
    return "  none" if value is None else f"{value:+.3f}"  # none: not trained (dropped or rejected)


def format_group(rec: dict, *, min_reward: float | None = None) -> str | None:
    comps = [c for c in rec["completions"] if min_reward is None or c["reward"] >= min_reward]
    if not comps:
        return None
    judged = f" (archiver at v{rec['verdict_version']})" if "verdict_version" in rec else ""
    head = (
        f"== {rec['id']}  row {rec['row']}  producer {rec['producer']}  version {rec['policy_version']}  "
        f"{rec['verdict']}{judged}  {datetime.fromtimestamp(rec['published_at']).strftime('%H:%M:%S')}"
    )
    lines = [head, f"prompt: {rec['prompt']!r}"]
    for c in comps:
        lines.append(
            f"  reward {c['reward']:+.3f}  adv {_adv(c['advantage'])}  {_versions(c)}  "
            f"{c['finish_reason']:<6} {c['text']!r}"
        )
    return "\n".join(lines)


def _versions(c: dict) -> str:
    """``v3``, or the tokens each version sampled when there were several: ``v3[0:17] v4[17:40]``."""
    spans = c.get("spans")
    if not spans or len({v for _, _, v in spans}) == 1:
        return f"v{c['version']}"
    return " ".join(f"v{v}[{a}:{b}]" for a, b, v in spans)


def samples_main(cfg: RunConfig, args: argparse.Namespace) -> int:
    directory = archive_dir(cfg)
    files = sorted(directory.glob(PATTERN)) if directory.is_dir() else []
    if not files:
        print(
            f"streamer samples: no rollout archive for run {cfg.run.name!r} in {directory} "
            "(check --run / --data-dir, or is the archiver running?)",
            file=sys.stderr,
        )
        return 2
    tail = ArchiveTail(directory, files[-1])
    recent = tail.records()  # the newest file, and any the archiver started since
    for f in reversed(files[:-1]):  # older, complete ones, newest first, until enough
        if len(recent) >= args.last:
            break
        recent = file_records(f) + recent
    for rec in recent[-args.last :]:
        _print(rec, args.min_reward)
    if not args.follow:
        return 0
    try:
        while True:
            time.sleep(FOLLOW_POLL)
            for rec in tail.records():  # only what was appended since
                _print(rec, args.min_reward)
    except KeyboardInterrupt:
        return 0


def _print(rec: dict, min_reward: float | None) -> None:
    try:
        text = format_group(rec, min_reward=min_reward)
    except (ValueError, KeyError, TypeError):
        return
    if text:
        print(text, flush=True)


def dead_main(cfg: RunConfig, args: argparse.Namespace) -> int:
    keys = Keys(cfg.run.name)
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout)
    if not client.exists(keys.traj, keys.policy, keys.metrics, keys.dead, keys.version):
        print(f"streamer dead: no run {cfg.run.name!r} on {redact(cfg.run.redis_url)}", file=sys.stderr)
        return 2
    if args.replay:
        return _replay(client, keys, args.replay)
    rows = client.xrevrange(keys.dead, count=args.last)
    print(f"{client.xlen(keys.dead)} dead letters in {keys.dead}; newest {len(rows)}:")
    for raw_id, fields in reversed(rows):
        entry_id = as_str(raw_id)
        try:
            d = entry_event(fields, DeadLetter)
        except DecodeError as e:
            print(f"{entry_id}  (undecodable dead letter: {e.reason})")
            continue
        when = datetime.fromtimestamp(d.at).strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{entry_id}  {when}  {d.stream} {d.entry_id}  by {d.consumer or '?'}  {len(d.raw)} bytes\n  {d.reason}"
        )
    return 0


def _replay(client, keys: Keys, dead_id: str) -> int:
    """Re-publish one dead letter, named by its full entry id, at most once ever."""
    if not ENTRY_ID.match(dead_id):  # XRANGE reads "1234" as every entry of that millisecond
        print(
            f"streamer dead: --replay needs a full dead-letter id such as 1700000000000-0, as "
            f"`streamer dead` lists them, not {dead_id!r}",
            file=sys.stderr,
        )
        return 2
    rows = client.xrange(keys.dead, min=dead_id, max=dead_id)
    if not rows:
        print(f"streamer dead: no dead letter {dead_id!r} in {keys.dead}", file=sys.stderr)
        return 2
    d = entry_event(rows[0][1], DeadLetter)
    if not d.stream.startswith(keys.prefix + ":"):
        print(f"streamer dead: {dead_id} came from {d.stream!r}, not a stream of this run", file=sys.stderr)
        return 2
    done, new_id = client.register_script(REPLAY)(
        keys=[keys.replayed, d.stream, keys.dead], args=[dead_id, FIELD, d.raw]
    )
    if int(done) < 0:
        print(f"streamer dead: dead letter {dead_id} was deleted meanwhile", file=sys.stderr)
        return 2
    if int(done) == 0:
        print(f"dead letter {dead_id} was re-published before, as {as_str(new_id)}; not again")
        return 0
    print(f"re-published dead letter {dead_id} to {d.stream} as {as_str(new_id)}")
    return 0
