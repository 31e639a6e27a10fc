"""The trainer SIGKILLed at seeded random points, 5 times in one run, fed by a real producer
process: the persisted model holds every accepted group exactly once and nothing is lost.

tests/test_checkpoint.py does this with a synthetic publisher and 4 kills; here the groups
come from a `streamer produce` process (sampling from a fake inference server, following
and checking every policy version), so rejections, backpressure and weight syncs all
happen for real while the trainer dies.
"""

from __future__ import annotations

import random
import time

import pytest
from bounds import RUN, START
from harness import audit, audited_client, policy_version_list, report, run_config_in
from waits import wait_until

from consumers import checkpoint
from streamer.config import TrainerSection
from streamer.keys import Keys

pytestmark = pytest.mark.slow

KILLS, STEPS = 5, 24
TRAINER = {"groups_per_step": 2, "steps": STEPS, "checkpoint_every": 2, "max_staleness": 1000}


def test_trainer_sigkilled_five_times_loses_and_repeats_nothing(private_valkey, procs, inference, tmp_path):
    rng = random.Random(20261207)
    url, keys = private_valkey.url, Keys("tkill")
    client = audited_client(url, keys)
    server, _ = inference
    server.latency = 0.03  # paces the producer (~70 ms a step): kills land within steps, not after the run
    config = run_config_in(tmp_path, keys, sampler_url=server.url, bus={"max_unacked": 32}, trainer=TRAINER)
    ckpt_dir = tmp_path / "data" / keys.run / "checkpoints"
    procs.start("producer", "produce", "--config", str(config), "--redis-url", url, "--id", "p0")
    redone, restores = 0, 0  # restores: starts that found a checkpoint, so must log its restore
    for kill in range(KILLS):
        before = client.xlen(keys.policy)
        restores += checkpoint.latest(ckpt_dir) is not None
        trainer = procs.start("trainer", "train", "--config", str(config), "--redis-url", url)
        target = before + 1 + rng.randint(1, 3)  # its first version (the restored weights), then 1-3 steps
        wait_until(  # the first kill waits for a checkpoint too: every restart resumes from one
            lambda t=target, p=trainer, k=kill: (
                (client.xlen(keys.policy) >= t and (k > 0 or checkpoint.latest(ckpt_dir) is not None))
                or p.poll() is not None
            ),
            timeout=START,
            what=f"kill {kill}: {target} policy versions" + ("" if kill else " and a checkpoint"),
            watch=procs,
        )
        assert trainer.poll() is None, f"the trainer exited before kill {kill}\n{procs.tails()}"
        time.sleep(rng.uniform(0.0, 0.1))  # a random point of the step / version / checkpoint cycle
        trainer.kill()
        trainer.wait(30)
        chain = checkpoint.audit_chain(ckpt_dir)
        redone += _last_step(client, keys) - (chain[-1].step if chain else 0)
        _assert_exactly_once_so_far(client, keys, ckpt_dir, kill)

    restores += checkpoint.latest(ckpt_dir) is not None
    procs.start("trainer", "train", "--config", str(config), "--redis-url", url)
    assert procs.wait("trainer", RUN) == 0, procs.tails()
    assert procs.stop("producer") == 0, procs.tails()

    result = audit(client, keys, ckpt_dir, TrainerSection(**TRAINER))
    chain = checkpoint.audit_chain(ckpt_dir)
    versions = policy_version_list(client, keys)
    report(
        "trainer-sigkill",
        kills=KILLS,
        trainer_starts=KILLS + 1,
        **result.figures,
        steps_lost_to_kills_and_redone=redone,
        versions=len(versions),
        repeated_versions=len(versions) - len(set(versions)),
        dead_letters=client.xlen(keys.dead),
        crashed=0,
    )
    assert not result.lost, f"lost groups: {result.lost[:5]}"
    assert not result.duplicated, f"trained twice: {result.duplicated[:5]}"
    assert result.undecodable == 0 and client.xlen(keys.dead) == 0
    assert result.trained == sum(len(m.entry_ids) for m in chain) >= STEPS * TRAINER["groups_per_step"]
    assert chain[-1].step == STEPS
    assert versions == sorted(set(versions)), f"policy versions repeat or go back: {versions}"
    assert restores == KILLS and procs.log("trainer").count("restored checkpoint") == restores


def _last_step(client, keys: Keys) -> int:
    from trainer_data import policy_versions

    return max((s for _, s in policy_versions(client, keys.policy)), default=0)


def _assert_exactly_once_so_far(client, keys: Keys, ckpt_dir, kill: int) -> None:
    groups = [g for m in checkpoint.audit_chain(ckpt_dir) for g in m.group_ids]
    assert len(groups) == len(set(groups)), f"after kill {kill}: a group is in the model twice"
    versions = policy_version_list(client, keys)
    assert versions == sorted(set(versions)), f"after kill {kill}: versions repeat: {versions}"
