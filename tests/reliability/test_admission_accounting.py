"""Admission accounting that cannot leak, go negative or wedge.

Every slot has an owner (a row lease, then a published entry); the counter moves only when
an owner set changes. Driven here with real trainer and producer processes:

- dead-lettered groups give their slot back: a window held entirely by junk entries
  unblocks as soon as the trainer dead-letters them;
- groups that never took a slot (published by hand) give back nothing when rejected: the
  counter never goes negative;
- a resume with a smaller ``groups_per_step`` keeps training;
- ``bus.max_unacked < trainer.groups_per_step`` is a config error at load time.
"""

from __future__ import annotations

import random

import pytest
from harness import report, run_config, run_config_in
from trainer_data import make_group, publish
from waits import wait_until

from streamer.admission import Admission, Leases
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


def _junk_holding_slots(client, keys: Keys, n: int, *, staleness: int, per_step: int) -> list[str]:
    """``n`` undecodable entries published the producers' way: each holds an admission slot."""
    leases = Leases(client, keys, owner="junk", lease_seconds=600)
    admission = Admission(client, keys, max_staleness=staleness, groups_per_step=per_step)
    ids = []
    for _ in range(n):
        ticket = leases.claim()
        assert admission.try_admit(ticket, "junk")
        ids.append(leases.publish(ticket, b"\xc1 not msgpack").entry_id)
    assert not admission.try_admit(leases.claim(), "junk"), "the window should be full"
    return ids


def test_dead_letters_and_slotless_rejections_neither_wedge_nor_go_negative(
    private_valkey, procs, inference, tmp_path
):
    url, keys = private_valkey.url, Keys("adm")
    client = connect(url)
    server, _ = inference
    trainer = {"groups_per_step": 2, "max_staleness": 0, "steps": 4, "checkpoint_every": 2}
    config = run_config_in(tmp_path, keys, sampler_url=server.url, trainer=trainer)
    junk = _junk_holding_slots(client, keys, 2, staleness=0, per_step=2)  # the whole window
    client.delete(keys.leases, keys.lease_owner, keys.lease_slots, keys.requeue)  # the junk producer's
    rng = random.Random(3)
    flat = [make_group(rng, version=0, rewards=(1, 1, 1, 1)) for _ in range(40)]  # zero variance
    publish(client, keys.traj, flat)  # never admitted: their rejection must release nothing
    args = ("--config", str(config), "--redis-url", url)
    procs.start("trainer", "train", *args)
    procs.start("producer", "produce", *args, "--id", "p0")
    lowest = [0]

    def done() -> bool:
        lowest[0] = min(lowest[0], int(client.get(keys.admitted) or 0))
        return procs.procs["trainer"].poll() is not None

    wait_until(done, timeout=240, what="the trainer's 4 steps", watch=procs)
    assert procs.wait("trainer", 5) == 0, procs.tails()
    assert procs.stop("producer") == 0, procs.tails()
    admitted = int(client.get(keys.admitted))
    dead = client.xlen(keys.dead)
    report("admission-dead-letters", dead_letters=dead, rejected_slotless=len(flat), lowest=lowest[0])
    assert dead == len(junk) and lowest[0] >= 0 and admitted >= 0
    assert not set(junk) & {m.decode() for m in client.smembers(keys.held_slots)}


def test_resume_with_a_smaller_groups_per_step_keeps_training(private_valkey, procs, inference, tmp_path):
    url, keys = private_valkey.url, Keys("shrink")
    client = connect(url)
    server, _ = inference
    runs = []
    for per_step, steps in ((4, 3), (2, 7)):  # a halved groups_per_step on resume, kept small
        config = run_config(
            tmp_path / f"run-{per_step}.toml",
            keys,
            tmp_path / "data",
            trainer={"groups_per_step": per_step, "max_staleness": 0, "steps": steps, "checkpoint_every": 1},
            producer={"sampler": "remote", "remote_url": server.url},
        )
        args = ("--config", str(config), "--redis-url", url)
        procs.start("producer", "produce", *args, "--id", "p0")
        procs.start("trainer", "train", *args)
        code = procs.wait("trainer", 240)
        assert procs.stop("producer") == 0, procs.tails()
        assert code == 0, procs.tails()
        runs.append(int(client.get(keys.admitted)))
    report("admission-shrink", steps="3@4+4@2", in_flight_after=runs)
    assert all(0 <= n <= 8 for n in runs), runs


def test_a_window_smaller_than_a_step_is_a_config_error(tmp_path, redis_url):
    import os
    import subprocess
    import sys

    from trainer_data import REPO

    config = run_config(
        tmp_path / "run.toml", Keys("small"), tmp_path, trainer={"groups_per_step": 8}, bus={"max_unacked": 4}
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "streamer", "train", "--config", str(config), "--redis-url", redis_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "`bus.max_unacked` (4) must be >= `trainer.groups_per_step` (8)" in res.stderr, res.stderr
