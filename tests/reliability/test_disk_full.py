"""The trainer's disk fills up, then turns read-only, under a running trainer.

The run directory (weights and checkpoints) lives on a small tmpfs the test mounts (root
only: skipped elsewhere, a failure under ``CI=true``). First the test fills it; later it
remounts it read-only. Each time the trainer must stop with one clear error line (exit 1),
leave no corrupt or partial checkpoint or weights version behind (everything is written to
a temp dir and renamed), and the previous checkpoint must still load: the second trainer
process resumes from it.
"""

from __future__ import annotations

import errno
import random
import subprocess
import uuid

import pytest
from bounds import RUN, START
from harness import TRAINER, report, run_config
from needs import need
from trainer_data import make_group, publish
from waits import wait_until

from consumers import checkpoint
from consumers.learner import Learner
from schemas import WeightSync
from streamer import demo, weights
from streamer.bus import entry_event, unacked
from streamer.config import TrainerSection
from streamer.connection import connect
from streamer.errors import WeightsError
from streamer.keys import Keys

pytestmark = pytest.mark.slow

LEAVE = 640 * 1024  # room for a policy version (~310 KB) but not a checkpoint (~930 KB)


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    need(r.returncode == 0, f"cannot mount a tmpfs here (needs root, CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory, *, leave: int) -> int:
    """Fill the filesystem but ``leave`` bytes; returns the bytes written."""
    written, chunk = 0, b"\0" * (64 * 1024)
    with open(directory / f"filler-{uuid.uuid4().hex[:6]}", "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        f.truncate(written - leave)
    return written - leave


def _remount_read_only(mnt) -> bool:
    return (
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, check=False).returncode
        == 0
    )


def _state(ckpt_dir, weights_dir, client, keys) -> dict:
    """Checkpoints and weight versions on disk: none partial, none corrupt."""
    names = [p.name for p in ckpt_dir.iterdir()] if ckpt_dir.exists() else []
    complete, corrupt = 0, []
    for path in checkpoint.candidates(ckpt_dir):
        meta = checkpoint.read_meta(path)
        if len(list(path.iterdir())) == 1:  # pruned to its state.json: the audit chain
            continue
        try:
            checkpoint.verify(path)
            complete += 1
        except checkpoint.CheckpointError as e:
            corrupt.append(f"{meta.name}: {e}")
    syncs = {s.version: s for s in (entry_event(f, WeightSync) for _, f in client.xrange(keys.policy))}
    bad_versions = []
    for d in weights_dir.iterdir():
        if d.name.startswith("v"):
            v = int(d.name[1:])
            try:
                weights.resolve(syncs[v], weights_dir, verify="full")
            except (KeyError, WeightsError):
                bad_versions.append(d.name)
    temps = [n for n in names if n.startswith(".tmp")] + [p.name for p in weights_dir.glob(".tmp*")]
    return {"complete": complete, "corrupt": corrupt, "bad_versions": bad_versions, "temp_dirs": temps}


def _error_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith("streamer train:")]


def _after_failure(ckpt_dir, weights_dir, client, keys, log: str, code: int, *, temp_ok: bool) -> dict:
    """What a failed write left behind; the newest checkpoint must still load. A temp dir
    cannot be removed from a read-only disk (``temp_ok``): readers never look at one, and
    the next trainer's prune removes it."""
    state = _state(ckpt_dir, weights_dir, client, keys)
    path, meta = checkpoint.latest(ckpt_dir)
    learner = Learner(demo.build_model(99), TrainerSection(**TRAINER))
    checkpoint.restore(path, meta, model=learner.model, optimizer=learner.optimizer)
    groups = [g for m in checkpoint.audit_chain(ckpt_dir) for g in m.group_ids]
    errors = _error_lines(log)
    assert code == 1 and len(errors) == 1, f"exit {code}, error lines {errors}\n{log[-3000:]}"
    assert state["corrupt"] == [] and state["bad_versions"] == [] and (temp_ok or not state["temp_dirs"]), (
        state
    )
    assert len(groups) == len(set(groups)), "a group is in the model twice"
    return {
        "exit": code,
        "error": errors[0].split(": ", 1)[1],
        "latest_loads": meta.name,
        "corrupt": len(state["corrupt"]),
        "temp_dirs_left": len(state["temp_dirs"]),
        "bad_versions": len(state["bad_versions"]),
    }


def test_disk_full_then_read_only(small_disk, redis_url, keys: Keys, procs, tmp_path):
    rng = random.Random(11)
    client = connect(redis_url)
    groups = [make_group(rng) for _ in range(60)]
    publish(client, keys.traj, groups[:4])  # two steps, then the trainer waits for data
    config = run_config(tmp_path / "run.toml", keys, small_disk, trainer=TRAINER)
    args = ("--config", str(config), "--redis-url", redis_url)
    ckpt_dir, weights_dir = small_disk / keys.run / "checkpoints", small_disk / keys.run / "weights"

    # 1. the disk fills up while the trainer waits after its first checkpoint: with room for
    #    a policy version but not a checkpoint, the step-4 checkpoint fails mid-write
    procs.start("trainer", "train", *args)
    wait_until(
        lambda: checkpoint.latest(ckpt_dir) is not None and unacked(client, keys.traj) == 0,
        timeout=START,
        what="the step-2 checkpoint, everything acknowledged",
        watch=procs,
    )
    _fill(small_disk, leave=LEAVE)
    publish(client, keys.traj, groups[4:12])
    code = procs.wait("trainer", RUN)
    full = _after_failure(ckpt_dir, weights_dir, client, keys, procs.log("trainer"), code, temp_ok=False)
    assert "cannot write checkpoint" in full["error"] and "No space left on device" in full["error"]

    # 2. space again: the next trainer resumes from that checkpoint and trains what is there
    #    (steps 3-6, checkpointed, so it then waits for data with no file open); the disk
    #    turns read-only; only then does new data arrive, so the next write must fail
    for f in small_disk.glob("filler-*"):
        f.unlink()
    mark = len(procs.log("trainer"))
    procs.start("trainer", "train", *args)
    wait_until(
        lambda: (  # latest() is None for a moment while the trainer prunes the old one
            (latest := checkpoint.latest(ckpt_dir)) is not None
            and latest[1].name != full["latest_loads"]
            and unacked(client, keys.traj) == 0
        ),
        timeout=START,
        what="a checkpoint after the resume, everything acknowledged",
        watch=procs,
    )
    wait_until(
        lambda: _remount_read_only(small_disk),
        timeout=20,
        interval=0.01,
        what="remounting read-only (busy while a file is open for writing)",
    )
    publish(client, keys.traj, groups[12:])
    code = procs.wait("trainer", RUN)
    log = procs.log("trainer")[mark:]
    ro = _after_failure(ckpt_dir, weights_dir, client, keys, log, code, temp_ok=True)
    report("trainer-disk", disk_full=full, read_only=ro, lost=0, duplicated=0, crashed=0)
    assert f"restored checkpoint {full['latest_loads']}" in log
    assert "Read-only file system" in ro["error"]
