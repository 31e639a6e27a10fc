"""The trainer stalled (SIGSTOP) past bus.claim_idle_seconds, then resumed (SIGCONT).

The trainer is one consumer by design (`trainer-0`): a second *trainer* would be a second
model, so "another consumer trains its entries" is not a state the system may reach. What
must hold instead, and is checked here over two stalls:

1. alone, the stalled trainer finds its entries as it left them and trains each once;
2. when another consumer of the group (a standby, an operator's tool) XAUTOCLAIMs the idle
   entries during the stall, the resumed trainer takes back the ones it owns (XCLAIM, which
   does not count a delivery), trains each once, and its late XACK after the checkpoint
   clears them wherever they sit: nothing stays pending, nothing is dead-lettered, nothing
   is trained twice or lost.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from bounds import RUN, START
from harness import audit, audited_client, report, run_config_in
from waits import wait_until

from streamer.config import TrainerSection
from streamer.keys import TRAINER_GROUP

pytestmark = pytest.mark.slow

CLAIM_IDLE = 1.0
STALL = CLAIM_IDLE * 2.5  # how long the held entries stay idle while the trainer is stopped
BUS = {"claim_idle_seconds": CLAIM_IDLE, "block_seconds": 0.25, "socket_timeout": 2.0, "max_unacked": 24}
TRAINER = {"groups_per_step": 2, "steps": 12, "checkpoint_every": 3, "max_staleness": 1000}


def _pending(client, keys, consumer: str) -> list[str]:
    rows = client.xpending_range(keys.traj, TRAINER_GROUP, "-", "+", 10_000, consumername=consumer)
    return [r["message_id"].decode() for r in rows]


def _idle_ms(client, keys, consumer: str) -> list[int]:
    """Milliseconds since each pending entry of ``consumer`` was delivered (server clock)."""
    rows = client.xpending_range(keys.traj, TRAINER_GROUP, "-", "+", 10_000, consumername=consumer)
    return [int(r["time_since_delivered"]) for r in rows]


def _stopped(pid: int) -> bool:
    """The process is in state T (stopped by a signal), not merely sent SIGSTOP."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


def _stall(trainer, client, keys, procs, *, standby: bool, attempts: int = 20) -> dict:
    """SIGSTOP the trainer while it holds pending entries, past the claim idle time; resume."""
    for _ in range(attempts):
        wait_until(
            lambda: len(_pending(client, keys, "trainer-0")) >= 2,
            timeout=60,
            what="the trainer holding pending entries",
            watch=procs,
        )
        os.kill(trainer.pid, signal.SIGSTOP)
        wait_until(lambda: _stopped(trainer.pid), timeout=10, what="the trainer stopped", watch=procs)
        held = _pending(client, keys, "trainer-0")
        if held:
            break
        os.kill(trainer.pid, signal.SIGCONT)  # it acknowledged everything just before: again
    else:
        raise AssertionError("could not stop the trainer while it held pending entries")
    wait_until(  # the stall: until the server counts every held entry idle for STALL seconds
        lambda: min(_idle_ms(client, keys, "trainer-0"), default=0) >= STALL * 1000,
        timeout=60,
        what=f"the held entries idle for {STALL} s",
        watch=procs,
    )
    claimed = []
    if standby:  # what a second consumer's Consumer.read() does first: XAUTOCLAIM idle entries
        _, entries, _ = client.xautoclaim(
            keys.traj, TRAINER_GROUP, "standby", int(CLAIM_IDLE * 1000), count=1000
        )[:3]
        claimed = [entry_id.decode() for entry_id, _ in entries]
    os.kill(trainer.pid, signal.SIGCONT)
    resumed = time.monotonic()
    if standby:
        wait_until(
            lambda: not _pending(client, keys, "standby"),
            timeout=30,
            what="the trainer taking back or acknowledging the claimed entries",
            watch=procs,
        )
    return {"held": len(held), "claimed": claimed, "cleared_after": round(time.monotonic() - resumed, 2)}


def test_trainer_stalled_past_claim_idle_trains_its_entries_once(redis_url, keys, procs, inference, tmp_path):
    server, _ = inference
    server.latency = 0.05  # paces the producer: both stalls fall inside the run
    client = audited_client(redis_url, keys)
    config = run_config_in(tmp_path, keys, sampler_url=server.url, bus=BUS, trainer=TRAINER)
    args = ("--config", str(config), "--redis-url", redis_url)
    procs.start("producer", "produce", *args, "--id", "p0")
    trainer = procs.start("trainer", "train", *args)
    wait_until(lambda: client.xlen(keys.policy) >= 3, timeout=START, what="2 trainer steps", watch=procs)
    alone = _stall(trainer, client, keys, procs, standby=False)
    taken = _stall(trainer, client, keys, procs, standby=True)
    assert procs.wait("trainer", RUN) == 0, procs.tails()
    assert procs.stop("producer") == 0, procs.tails()

    result = audit(client, keys, tmp_path / "data" / keys.run / "checkpoints", TrainerSection(**TRAINER))
    chain_entries = {e for m in _chain(tmp_path, keys) for e in m.entry_ids}
    report(
        "consumer-stall",
        stalls=2,
        stall_seconds=STALL,
        claim_idle_seconds=CLAIM_IDLE,
        held_alone=alone["held"],
        held_with_standby=taken["held"],
        claimed_by_standby=len(taken["claimed"]),
        reclaimed_or_acked_after_seconds=taken["cleared_after"],
        **result.figures,
        dead_letters=client.xlen(keys.dead),
        crashed=0,
    )
    assert taken["claimed"], "the standby claimed nothing: the stall did not pass the idle time"
    assert set(taken["claimed"]) <= chain_entries, "a claimed entry was not trained"
    assert not _pending(client, keys, "standby")
    assert not result.lost and not result.duplicated
    assert client.xlen(keys.dead) == 0


def _chain(tmp_path, keys):
    from consumers import checkpoint

    return checkpoint.audit_chain(tmp_path / "data" / keys.run / "checkpoints")
