"""`streamer rows`: how many dataset rows are active, solved and unsolvable; ``reset``
forgets every row's record, so rows set aside (streamer/rows.py) are handed out again.

Checkpoints, policy versions and the dataset position are kept. With the embedded server
(no ``run.redis_url``) use ``streamer up --reset-rows``, which does the same as it starts.
"""

from __future__ import annotations

import argparse

from streamer import rows
from streamer.config import RunConfig
from streamer.connection import connect
from streamer.keys import Keys


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="streamer-rows")
    keys = Keys(cfg.run.name)
    if args.action == "reset":
        n = rows.reset(client, keys)
        print(f"run {cfg.run.name}: every row record forgotten; {n} rows set aside are active again")
        return 0
    c = rows.counts(client, keys)
    print(
        f"run {cfg.run.name}: {c.active} active, {c.solved} solved, {c.unsolvable} unsolvable "
        f"(of {c.total or '?'} rows; solved and unsolvable rows are set aside)"
    )
    return 0
