"""What the server keeps of a run for its trainer, and what a starting trainer reads back:
the run's marker (when it was created, whether the server lost its data, its newest
checkpoint), the next policy version number (never one used before) and the policy
history the lineage is rebuilt from."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from schemas import WeightSync
from streamer import weights
from streamer.bus import scan
from streamer.errors import StreamerError
from streamer.keys import Keys
from streamer.tail import Tail
from streamer.values import parse_int

log = logging.getLogger(__name__)


def check_server_state(client, keys: Keys, parent: str | None) -> None:
    """Mark the run on the server; a checkpoint ``parent`` without the run's marker key means
    the server lost this run's data: say so, once, in the log and in the marker."""
    marker = keys.run_marker
    if client.exists(marker):
        return
    now = time.time()
    # no marker but a policy: a run from before markers existed, not a loss
    empty = not client.exists(keys.policy, keys.version)
    if parent is not None and empty:
        log.error(
            "the server has no state for run %s, but checkpoint %s exists: the server lost its "
            "data (restarted without persistence, or flushed). The model is safe: training resumes "
            "from %s under a new version number; the groups in flight were lost with the server "
            "(the dataset position comes back from the checkpoint). If the server should still "
            "have them, stop now and restore its data (AOF/RDB) before starting the trainer again.",
            keys.run,
            parent,
            parent,
        )
        client.hset(marker, mapping={"data_lost_at": now, "resumed_from": parent})
    client.hsetnx(marker, "created_at", now)


def next_version(client, keys: Keys, *, checkpointed: int, weights_dir: Path) -> int:
    """One past the newest version anywhere: policy stream, version key, the checkpoint's
    (``checkpointed``), the weights on disk (a server that lost its data must not make
    numbers repeat)."""
    newest = Tail(client, keys.policy, as_type=WeightSync).latest()
    known = [v.version for v in [newest] if v is not None]
    if (raw := client.get(keys.version)) is not None:
        known.append(parse_int(raw, keys.version))
    if newest is None and client.xlen(keys.policy):
        raise StreamerError(f"newest entry of {keys.policy} does not decode; cannot pick a version")
    known += [checkpointed, *weights.versions(weights_dir)]
    return max(known) + 1 if max(known, default=-1) >= 0 else 0


def policy_history(client, keys: Keys) -> list[WeightSync]:
    """Every WeightSync on the policy stream, oldest first (one that does not decode: a warning)."""
    syncs = []
    for entry_id, sync in scan(client, keys.policy, WeightSync):
        if sync is None:
            log.warning("%s %s does not decode; left out of the lineage", keys.policy, entry_id)
        else:
            syncs.append(sync)
    return syncs


def record_checkpoint(client, keys: Keys, name: str) -> None:
    """Note on the server that the run has checkpoint ``name`` (see :func:`refuse_a_lost_checkpoint`)."""
    client.hset(keys.run_marker, "checkpoint", name)


def refuse_a_lost_checkpoint(client, keys: Keys, checkpoint_dir: Path) -> None:
    """StreamerError when ``checkpoint_dir`` holds no checkpoint but the server records one:
    another data dir, or its checkpoints were deleted. Starting from the initial weights
    would train on as if the run's progress never happened, so only when told to."""
    recorded = client.hget(keys.run_marker, "checkpoint")
    if recorded is None:
        return
    raise StreamerError(
        f"run {keys.run} has checkpoint {recorded.decode(errors='replace')} on the server's record, "
        f"but {checkpoint_dir} holds no checkpoint (another data dir, or its checkpoints were "
        "deleted): point --data-dir at the run's data, start over with `streamer up --fresh` or a "
        "new --run name, or pass --from-initial-weights to train this run on from the initial weights"
    )
