"""Backpressure against a trainer that rarely checkpoints: bus.max_unacked 16, 4 groups per
step, checkpoint_every 1000. Trained entries stay unacknowledged until a checkpoint covers
them, and producers wait while 16 are: without the early checkpoint (when trained-unacked
entries near half of max_unacked) the trainer would starve after 4 steps. The run must
complete its 12 steps, with two producer processes pushing as hard as they can.
"""

from __future__ import annotations

import threading

import pytest
from bounds import RUN, START
from harness import audit, audited_client, report, run_config_in
from waits import wait_until

from consumers import checkpoint
from streamer.bus import unacked
from streamer.config import TrainerSection

pytestmark = pytest.mark.slow

MAX_UNACKED, STEPS, PRODUCERS = 16, 12, 2
TRAINER = {"groups_per_step": 4, "steps": STEPS, "checkpoint_every": 1000, "max_staleness": 1000}


def test_run_completes_under_backpressure_with_rare_checkpoints(redis_url, keys, procs, inference, tmp_path):
    server, _ = inference
    client = audited_client(redis_url, keys)
    config = run_config_in(
        tmp_path,
        keys,
        sampler_url=server.url,
        trainer=TRAINER,
        bus={"max_unacked": MAX_UNACKED, "block_seconds": 0.5, "socket_timeout": 3.0},
    )
    args = ("--config", str(config), "--redis-url", redis_url)
    for i in range(PRODUCERS):
        procs.start(f"producer-{i}", "produce", *args, "--id", f"p{i}")
    wait_until(  # the trainer starts only once a producer is held back
        lambda: (
            unacked(client, keys.traj) >= MAX_UNACKED
            and any("backpressure:" in procs.log(f"producer-{i}") for i in range(PRODUCERS))
        ),
        timeout=START,
        what="producers filling the stream up to max_unacked and waiting",
        watch=procs,
    )
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], unacked(client, keys.traj))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs.start("trainer", "train", *args)
    try:
        code = procs.wait("trainer", RUN)
    finally:
        done.set()
        sampler.join(5)
    exits = [procs.stop(f"producer-{i}") for i in range(PRODUCERS)]

    ckpt = tmp_path / "data" / keys.run / "checkpoints"
    chain = checkpoint.audit_chain(ckpt)
    result = audit(client, keys, ckpt, TrainerSection(**TRAINER))
    waits = sum(procs.log(f"producer-{i}").count("backpressure:") for i in range(PRODUCERS))
    report(
        "backpressure",
        max_unacked=MAX_UNACKED,
        groups_per_step=4,
        checkpoint_every=1000,
        steps_completed=chain[-1].step if chain else 0,
        checkpoints=len(chain),
        peak_unacked=peak[0],
        producer_backpressure_waits=waits,
        **result.figures,
        crashed=sum(c != 0 for c in [code, *exits]),
    )
    assert code == 0, procs.tails()
    assert exits == [0] * PRODUCERS, procs.tails()
    assert chain[-1].step == STEPS
    assert len(chain) >= STEPS // 2, "the trainer did not checkpoint early to make room"
    assert waits >= 1, "the producers never waited: backpressure was not exercised"
    assert peak[0] <= MAX_UNACKED + PRODUCERS - 1  # check-then-publish: one overshoot per producer
    assert not result.lost and not result.duplicated
