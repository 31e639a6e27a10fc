"""Shared pieces of the reliability suite (fixtures in conftest.py): role processes, a fake
inference server with variance, the audit of a trajectory stream, the figures every test prints.

Each test prints one line ``RELIABILITY <name>: key=value ...`` (shown with ``-s``); with
``STREAMER_RELIABILITY_REPORT=<file>`` set, the same figures are appended to that file as
JSON lines. docs/RELIABILITY.md is written from these lines.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainer_data import REPO, write_config

from consumers import checkpoint
from consumers.filters import GroupFilter
from producers.samplers import Completion
from schemas import DeadLetter, DecodeError, TrajectoryGroup
from streamer import demo, lifecycle
from streamer.bus import entry_event
from streamer.config import TrainerSection
from streamer.connection import connect
from streamer.keys import TRAINER_GROUP, Keys

REPORT_ENV = "STREAMER_RELIABILITY_REPORT"
AUDIT_GROUP = "audit"  # a second group on the trajectory stream: nothing it has not acked is trimmed
# the trainer of the fault tests: small steps, a checkpoint every other step, nothing stale
TRAINER = {"groups_per_step": 2, "checkpoint_every": 2, "max_staleness": 1000}


def report(name: str, **figures) -> str:
    """Print the test's figures as one line (and append them to $STREAMER_RELIABILITY_REPORT)."""
    line = f"RELIABILITY {name}: " + " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\n{line}")
    if path := os.environ.get(REPORT_ENV):
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")
    return line


def rss_mb(pid: int) -> float:
    """Resident set size of a process, MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------- processes


class Procs:
    """Role processes of one test (`python -m streamer ROLE`), each logging to its own file;
    whatever is still running at the end of the test is killed."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str, *args: str, log_level: str = "INFO") -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path(name), "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "streamer", "--log-level", log_level, role, *args],
                cwd=self.dir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lifecycle.child_preexec(os.getpid()),  # SIGTERM if the test runner dies
            )
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def tails(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {n}.log\n{self.log(n)[-chars:]}" for n in self.procs)

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {timeout:.0f}s\n{self.tails()}") from None

    def stop(self, name: str, timeout: float = 30) -> int:
        """SIGTERM and wait: a role stopped this way must exit 0."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return self.wait(name, timeout)

    def crashed(self) -> str:
        """Processes that exited with an error (not 0, not killed by the test), with codes."""
        codes = {n: p.poll() for n, p in self.procs.items()}
        bad = {n: c for n, c in codes.items() if c not in (None, 0, -signal.SIGKILL, -signal.SIGTERM)}
        return ", ".join(f"{n} exited with code {c}" for n, c in bad.items())

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_config(path: Path, keys: Keys, data_dir: Path, **sections: dict) -> Path:
    """A TOML run config for ``keys.run`` with small, fast defaults (demo model and task)."""
    base = {
        "run": {"name": keys.run, "data_dir": str(data_dir)},
        "producer": {
            "group_size": 8,
            "max_new_tokens": 2,
            "torch_threads": 1,
            "reward": "streamer.demo:reward",
        },
        "trainer": {
            "groups_per_step": 2,
            "lr": 1e-3,
            "overlong": "keep",
            "keep_versions": 2,
            "keep_checkpoints": 1,
        },
        "eval": {"eval_every": 1000, "max_rows": 8, "max_new_tokens": 2},
    }
    for name, fields in sections.items():
        base[name] = {**base.get(name, {}), **fields}
    return write_config(path, base)


def run_config_in(tmp_path: Path, keys: Keys, *, sampler_url: str = "", **sections: dict) -> Path:
    """:func:`run_config` at ``tmp_path/run.toml`` with the data under ``tmp_path/data``; with
    ``sampler_url``, producers sample from that inference server."""
    if sampler_url:
        sections["producer"] = {
            "sampler": "remote",
            "remote_url": sampler_url,
            **sections.get("producer", {}),
        }
    return run_config(tmp_path / "run.toml", keys, tmp_path / "data", **sections)


# ---------------------------------------------------------------- a fake inference server


class NoisyBackend:
    """Completions for the demo task: the right digit or a random one (+ EOS), seeded, so
    groups have reward variance; ``hold()`` makes requests wait (a producer stuck mid-row)."""

    def __init__(self, seed: int, *, right: float = 0.5):
        self.rng, self.right = random.Random(seed), right
        self.tok = demo.tokenizer()
        self.lock = threading.Lock()
        self.free: float = float("inf")  # requests answered before the rest are held
        self.release = threading.Event()
        self.held: list[int] = []  # sampling seeds (one per ticket) of held requests

    def hold_after(self, n: float) -> None:
        with self.lock:
            self.free = n
            self.release.clear()

    def open(self) -> None:
        with self.lock:
            self.free = float("inf")
        self.release.set()

    def __call__(self, body: dict) -> list[Completion]:
        probe = "n" not in body  # a producer's readiness probe (one token, no n): never held
        with self.lock:
            hold = self.free <= 0 and not probe
            if hold:
                self.held.append(body.get("seed"))
            elif not probe:
                self.free -= 1
        if hold:
            self.release.wait()
        text = self.tok.decode(body["prompt"])
        a, b = (int(c) for c in text.split("=")[0][-3::2])  # "...a+b="
        out = []
        with self.lock:
            for _ in range(int(body.get("n", 1))):
                digit = a + b if self.rng.random() < self.right else self.rng.randrange(10)
                ids = [self.tok.convert_tokens_to_ids(str(digit)), self.tok.eos_token_id]
                out.append(Completion(ids, [-self.rng.uniform(0.05, 3.0) for _ in ids], "stop"))
        return out


# ---------------------------------------------------------------- the audit


def keep_everything(client, keys: Keys) -> None:
    """Create the audit group before anything is published, so the stream keeps every entry."""
    client.xgroup_create(keys.traj, AUDIT_GROUP, id="0", mkstream=True)


def audited_client(url: str, keys: Keys):
    """A client of ``url``; the run's trajectory stream keeps every entry (:func:`keep_everything`)."""
    client = connect(url)
    keep_everything(client, keys)
    return client


@dataclass
class Audit:
    """Every published trajectory entry, classified against the persisted model."""

    published: int = 0
    trained: int = 0  # in the checkpoint chain (exactly once)
    rejected: Counter = field(default_factory=Counter)  # acknowledged, filter reason
    waiting: int = 0  # not yet acknowledged, newer than the high-water id
    dead_lettered: int = 0  # acknowledged into the dead-letter stream (undecodable, unusable)
    lost: list = field(default_factory=list)  # acknowledged but neither trained nor rejectable
    duplicated: list = field(default_factory=list)  # trained more than once
    undecodable: int = 0  # and not dead-lettered

    @property
    def figures(self) -> dict:
        return {
            "published": self.published,
            "trained": self.trained,
            "rejected": sum(self.rejected.values()),
            "waiting": self.waiting,
            "dead_lettered": self.dead_lettered,
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
        }


def audit(client, keys: Keys, checkpoint_dir: Path, trainer: TrainerSection) -> Audit:
    """Classify every entry of the trajectory stream (kept by :func:`keep_everything`)."""
    chain = checkpoint.audit_chain(checkpoint_dir)
    trained_entries = Counter(e for m in chain for e in m.entry_ids)
    trained_groups = Counter(g for m in chain for g in m.group_ids)
    high_water = chain[-1].high_water if chain else "0-0"
    pending = {
        _s(r["message_id"]) for r in client.xpending_range(keys.traj, TRAINER_GROUP, "-", "+", 1_000_000)
    }
    group = next((g for g in client.xinfo_groups(keys.traj) if _s(g["name"]) == TRAINER_GROUP), None)
    delivered_to = _id(_s(group["last-delivered-id"])) if group else (0, 0)
    judge = GroupFilter.from_config(trainer)
    dead = {
        d.entry_id
        for d in (entry_event(f, DeadLetter) for _, f in client.xrange(keys.dead))
        if d.stream == keys.traj
    }
    out = Audit()
    out.duplicated = [g for g, n in trained_groups.items() if n > 1]
    for raw_id, fields in client.xrange(keys.traj):
        entry_id = _s(raw_id)
        out.published += 1
        if trained_entries[entry_id]:
            out.trained += 1
            continue
        acked = _id(entry_id) <= delivered_to and entry_id not in pending
        if acked and entry_id in dead:
            out.dead_lettered += 1
            continue
        try:
            g = entry_event(fields, TrajectoryGroup)
        except (DecodeError, KeyError):
            out.undecodable += 1
            continue
        verdict = judge(g, version=g.policy_version)  # staleness is judged by the tests' windows
        if acked and not verdict.accepted:
            out.rejected[verdict.reason] += 1
        elif not acked and _id(entry_id) > _id(high_water):
            out.waiting += 1
        else:
            out.lost.append((entry_id, g.group_id, "acked" if acked else "pending", verdict.reason))
    return out


def policy_version_list(client, keys: Keys) -> list[int]:
    from trainer_data import policy_versions

    return [v for v, _ in policy_versions(client, keys.policy)]


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
