"""The trainer under torchrun (consumers/distributed.py): CPU, gloo, 2 ranks.

Two ranks, each training its rows of every minibatch with the whole minibatch's
denominators and gradients summed over ranks, give the single-device step: per-step loss,
gradient norm and the weights after K steps agree to 1e-5, replicated (DDP's semantics) and
sharded (FSDP2, ``trainer.fsdp``) alike.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dp_steps import STEPS, run
from safetensors.torch import load_file
from trainer_data import make_group, publish, write_config
from waits import Watch, wait_until

from consumers import checkpoint
from streamer import demo
from streamer.connection import connect
from streamer.keys import Keys
from streamer.server import free_port
from streamer.weights import tied_keys

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.mark.parametrize("mode", ["replicate", "fsdp", "fsdp-token_budget"])
def test_two_ranks_equal_one_device_to_1e_5(tmp_path, mode):
    flags = {"replicate": [], "fsdp": ["fsdp"], "fsdp-token_budget": ["fsdp", "tokens"]}[mode]
    done = torchrun(str(HERE / "dp_steps.py"), str(tmp_path), *flags)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranked = json.loads((tmp_path / "metrics.json").read_text())
    weights = load_file(tmp_path / "weights.safetensors")
    single, state = run()
    assert len(ranked) == len(single) == STEPS
    for step, (a, b) in enumerate(zip(ranked, single)):
        for key in ("loss", "policy_loss", "grad_norm", "entropy", "clip_fraction", "is_weight_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key, a[key], b[key])
    # weights to 1e-5 absolute (they moved ~1e-2: rounding of a different summation order,
    # amplified by Adam on near-zero gradients such as the key biases', stays below 2e-6)
    model = demo.build_model(seed=0)
    initial = model.state_dict()
    assert set(state) - set(weights) <= tied_keys(model), "a weight is missing (FSDP leaves tied copies out)"
    worst = max(float((weights[n] - v).abs().max()) for n, v in state.items() if n in weights)
    moved = max(float((v - initial[n]).abs().max()) for n, v in state.items())
    assert worst <= 1e-5 and moved > 1e-3, (worst, moved)


# ---------------------------------------------------------------- the trainer process


def _config(tmp_path: Path, run: str, steps: int, *, fsdp: bool = False) -> Path:
    return write_config(
        tmp_path / f"{run}.toml",
        {
            "run": {"name": run, "data_dir": str(tmp_path / "data")},
            "bus": {"max_deliveries": 50},
            "trainer": {
                "groups_per_step": 3,
                "steps": steps,
                "checkpoint_every": 2,
                "max_staleness": 1000,
                "lr": 1e-3,
                "ppo_minibatches": 2,
                "micro_batch_size": 4,
                "keep_checkpoints": 1,
                "fsdp": fsdp,
            },
        },
    )


def _train(config: Path, url: str, nproc: int, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["-m", "streamer", "train", "--config", str(config), "--redis-url", url, *extra]
    if nproc == 1:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    return torchrun(*args, nproc=nproc, cwd=tmp_path)


def test_torchrun_trainer_equals_one_process_and_a_killed_rank_loses_nothing(private_valkey, tmp_path):
    rng = random.Random(7)
    client = connect(private_valkey.url)
    steps = 6
    groups = [make_group(rng, rewards=(1.0, 0.0, rng.random(), 1.0)) for _ in range(3 * steps)]
    runs = {n: Keys(n) for n in ("single", "ddp", "fsdp", "killed")}
    for keys in runs.values():
        publish(client, keys.traj, groups)

    for name, nproc in (("single", 1), ("ddp", 2), ("fsdp", 2)):
        config = _config(tmp_path, name, steps, fsdp=name == "fsdp")
        done = _train(config, private_valkey.url, nproc, tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = {
        n: load_file(tmp_path / "data" / n / "weights" / f"v{steps:08d}" / "model.safetensors")
        for n in ("single", "ddp", "fsdp")
    }
    for n in ("ddp", "fsdp"):
        assert final[n].keys() == final["single"].keys(), n
        worst = max(float((final[n][k] - v).abs().max()) for k, v in final["single"].items())
        assert worst <= 1e-5, (n, worst)

    # SIGKILL rank 1 of a sharded trainer mid-run: torchrun tears the group down; a restart
    # (every rank taking its shards of the full checkpoint) resumes, exactly once
    keys, config = runs["killed"], _config(tmp_path, "killed", steps, fsdp=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    cmd += [f"--master-port={free_port()}", "-m", "streamer", "train", "--config", str(config)]
    cmd += ["--redis-url", private_valkey.url]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    wait_until(
        lambda: client.xlen(keys.policy) >= 4,
        timeout=120,
        what="3 steps under torchrun",
        watch=Watch(agent, log=log),
    )
    victim = _rank_pid(agent.pid, rank=1)
    os.kill(victim, signal.SIGKILL)
    assert agent.wait(120) != 0, "torchrun reported success after a rank was killed"
    done = _train(config, private_valkey.url, 1, tmp_path, "--nproc", "2")  # the shortcut to torchrun
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chain = checkpoint.audit_chain(tmp_path / "data" / "killed" / "checkpoints")
    trained = [g for m in chain for g in m.group_ids]
    assert sorted(trained) == sorted(g.group_id for g in groups), "a group was lost or trained twice"
    assert chain[-1].step == steps and client.xlen(keys.traj) == 0


def _rank_pid(agent: int, *, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (read from /proc/<pid>/environ)."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {agent}")
