"""`streamer archive`: every rollout group as readable text, kept on disk for people.

The trainer trims trajectories once a checkpoint covers them, and they hold only token
ids; debugging a reward function starts from what the model wrote. The archiver is one
more consumer group (``archive``) on the trajectory stream. For each group it writes one
JSON line — the decoded prompt and completions, rewards, the version that sampled each
completion, the producer, the verdict of the trainer's filters and the advantages — to gzip
files under
``{run_dir}/archive/``: ``rollouts-000001.jsonl.gz``, a new file past
``archive.file_bytes``, the oldest deleted past ``archive.max_bytes``. It reads at most every
half second unless it is behind (a full batch), and each batch is flushed before it is
acknowledged, so `streamer samples --follow` sees a group within about a second.

The verdict is the archiver's own re-judgement with the trainer's filters, at the policy
version it reads the group under (recorded as ``verdict_by`` / ``verdict_version``): the
trainer judges a group when it reads it, possibly at another version, so a ``stale``
verdict may differ from the trainer's. The advantages are the trainer's computation: the
configured ``trainer.advantage`` over the samples the filters keep (``null`` for a dropped
sample and for every sample of a rejected group, which trains nothing).

It never holds training back: the trainer's trimming (:func:`streamer.bus.trim_acked`)
lets this group fall at most ``archive.max_lag`` entries behind, then trims past it (the
entries it never read are counted as skipped when it notices). If the disk is full or
the directory unwritable, it logs one line, stops writing, and from then on acknowledges
what it reads (pending entries first) as skipped, counted.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from consumers.filters import GroupFilter, Verdict
from schemas import TrajectoryGroup
from streamer import lifecycle, models
from streamer.bus import Consumer, Delivery
from streamer.config import RunConfig, TrainerSection
from streamer.connection import connect, retrying
from streamer.keys import ARCHIVE_GROUP, Keys
from streamer.rundir import ARCHIVE
from streamer.values import DataError, parse_int

log = logging.getLogger(__name__)

CONSUMER_NAME = "archiver"
PATTERN = "rollouts-*.jsonl.gz"
# seconds to let groups gather after a read that found less than a full batch: the read, the
# version, the gzip flush and the ack each cost the same for one group as for dozens
GATHER_SECONDS = 0.5
STOP_SERVER_WAIT = 10.0  # seconds a stopping archiver waits for an unreachable server


def archive_dir(cfg: RunConfig) -> Path:
    return cfg.run_dir / ARCHIVE


Advantage = Callable[[np.ndarray], np.ndarray]  # (G,) float64 rewards -> (G,) float32 advantages


def advantage_of(cfg: TrainerSection) -> Advantage:
    """``trainer.advantage`` as the trainer computes it (consumers/advantages.py), in numpy for
    the built-ins, so the archiver imports no torch; a user's function takes tensors, so it
    runs through torch (imported then)."""
    name = cfg.advantage
    if name == "grpo":
        return functools.partial(grpo_advantages, std_normalize=cfg.std_normalize, std_floor=cfg.std_floor)
    if name == "dr_grpo":
        return _dr_grpo
    if name == "rloo":
        return _rloo
    import torch

    from consumers import advantages as A

    fn = A.resolve(cfg)
    return lambda r: A.compute(fn, torch.from_numpy(r)).numpy()


def grpo_advantages(rewards: np.ndarray, *, std_normalize: bool, std_floor: float) -> np.ndarray:
    """(G,) float32 group advantages as the trainer's GRPO z-score computes them
    (:func:`consumers.advantages.group_advantages`), in numpy."""
    r = rewards.astype(np.float64)  # float32 sums of large rewards overflow to inf
    centered = r - r.mean()
    if std_normalize:
        centered = centered / max(float(r.std()), std_floor)  # the population std
    return centered.astype(np.float32)


def _dr_grpo(rewards: np.ndarray) -> np.ndarray:
    return (rewards - rewards.mean()).astype(np.float32)


def _rloo(rewards: np.ndarray) -> np.ndarray:
    g = len(rewards)
    if g < 2:
        return np.zeros(g, np.float32)  # no other sample to compare with
    return ((rewards - rewards.mean()) * (g / (g - 1))).astype(np.float32)


def trained_advantages(group: TrajectoryGroup, verdict: Verdict, advantage: Advantage) -> list:
    """Per sample of ``group``: the advantage the trainer trains it with (``advantage`` over the
    samples the filters kept), or None (dropped, or the group rejected)."""
    if not verdict.accepted:
        return [None] * len(group.samples)
    kept = verdict.group.samples
    if any(s.episode is not None for s in kept):  # over episodes, each fork given its episode's
        rewards = verdict.group.episode_rewards().astype(np.float64)
        values = np.asarray(advantage(rewards))[verdict.group.episode_index()].tolist()
    else:
        values = advantage(verdict.group.rewards().astype(np.float64)).tolist()  # as collate does
    out, j = [], 0
    for s in group.samples:  # the kept samples are a subsequence (a masked one is a copy, same tokens)
        if j < len(kept) and kept[j].tokens is s.tokens:
            out.append(round(values[j], 6))
            j += 1
        else:
            out.append(None)
    return out


def record(
    entry_id: str, group: TrajectoryGroup, *, decode_text, verdict: str, advantages, verdict_version: int
) -> dict:
    """One group as a JSON-able dict of text and numbers."""
    first = group.samples[0]
    return {
        "id": entry_id,
        "group_id": group.group_id,
        "row": group.row,
        "epoch": group.epoch,
        "producer": group.producer_id,
        "policy_version": group.policy_version,
        "created_at": group.created_at,
        "published_at": group.published_at,
        "verdict": verdict,
        "verdict_by": "archiver",  # re-judged here, not the trainer's own verdict
        "verdict_version": verdict_version,
        "prompt": decode_text(first.token_ids()[: first.prompt_len].tolist()),
        "completions": [_completion(s, a, decode_text) for s, a in zip(group.samples, advantages)],
    }


def _completion(s, advantage, decode_text) -> dict:
    out = {
        "text": decode_text(s.completion_ids().tolist()),
        "reward": s.reward,
        "advantage": advantage,
        "version": s.version,
        "finish_reason": s.finish_reason,
        "tokens": s.completion_len,
    }
    if s.spans is not None:  # several turns, or the weights changed mid-completion
        out["spans"] = [[sp.start, sp.end, sp.version] for sp in s.spans]
    if s.episode is not None:  # a fork: one episode's piece, with a prompt of its own
        out["episode"] = s.episode
        out["prompt"] = decode_text(s.token_ids()[: s.prompt_len].tolist())
    return out


class RotatingWriter:
    """gzip JSONL files in one directory: rotate past ``file_bytes``, keep ``max_bytes``."""

    def __init__(self, directory: Path, *, file_bytes: int, max_bytes: int):
        self.dir, self.file_bytes, self.max_bytes = Path(directory), file_bytes, max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.dir.glob(PATTERN))
        self.index = int(existing[-1].name.split("-")[1].split(".")[0]) if existing else 0
        self._gz: gzip.GzipFile | None = None
        self._path: Path | None = None

    def write(self, lines: list[str]) -> None:
        if self._gz is None:
            self.index += 1
            self._path = self.dir / f"rollouts-{self.index:06d}.jsonl.gz"
            self._gz = gzip.GzipFile(self._path, mode="ab")  # closed on rotation / close()
        self._gz.write("".join(line + "\n" for line in lines).encode())
        self._gz.flush()  # a sync flush: readers see every line written so far
        if self._path.stat().st_size >= self.file_bytes:
            self.close()
            self._prune()

    def _prune(self) -> None:
        files = sorted(self.dir.glob(PATTERN))
        sizes = {f: f.stat().st_size for f in files}
        while len(files) > 1 and sum(sizes[f] for f in files) > self.max_bytes:
            files.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        if self._gz is not None:
            try:
                self._gz.close()
            finally:
                self._gz = None


class Archiver:
    def __init__(self, cfg: RunConfig, *, client=None, tokenizer=None):
        self.cfg, self.keys = cfg, Keys(cfg.run.name)
        self.client = client or connect(
            cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name="streamer-archive"
        )
        self.tokenizer = tokenizer or models.load_decoder(cfg.model)  # no torch, no model class
        self.filter = GroupFilter.from_config(cfg.trainer)
        self.advantage = advantage_of(cfg.trainer)
        self.consumer = Consumer(
            self.client,
            self.keys,
            self.keys.traj,
            ARCHIVE_GROUP,
            CONSUMER_NAME,
            as_type=TrajectoryGroup,
            cfg=cfg.bus,
        )
        self.writer: RotatingWriter | None = None
        self.archived = self.skipped = 0
        self.broken: str | None = None  # why archiving stopped (disk full, unwritable)
        self._bad_version = ""  # the version key's problem, logged once

    def step(self, block: float | None = None) -> int:
        """Read one batch; archive it (or skip it once broken); ack it. Entries read."""
        got = self.consumer.read(block=block)
        if not got:
            return 0
        if self.broken is None:
            try:
                self._write(got)
                self.archived += len(got)
            except OSError as e:
                self._break(e)
        if self.broken is not None:
            self.skipped += len(got)
        self.consumer.ack(d.id for d in got)
        return len(got)

    def _write(self, got: list[Delivery[TrajectoryGroup]]) -> None:
        if self.writer is None:
            a = self.cfg.archive
            self.writer = RotatingWriter(
                archive_dir(self.cfg), file_bytes=a.file_bytes, max_bytes=a.max_bytes
            )
        version = self._version()
        lines = []
        for d in got:
            at = d.event.policy_version if version is None else version
            verdict = self.filter(d.event, version=at)
            rec = record(
                d.id,
                d.event,
                decode_text=self._text,
                verdict=verdict.reason or "accepted",
                advantages=trained_advantages(d.event, verdict, self.advantage),
                verdict_version=at,
            )
            lines.append(json.dumps(rec, ensure_ascii=False))
        self.writer.write(lines)

    def _version(self) -> int | None:
        """The current policy version, for the verdicts; None (verdicts without staleness) when
        the version key holds something else: the archive is a record, never a reason to stop."""
        try:
            return parse_int(self.client.get(self.keys.version), self.keys.version, default=0)
        except DataError as e:
            if str(e) != self._bad_version:
                log.warning("archiving without staleness verdicts: %s", e)
                self._bad_version = str(e)
            return None

    def _text(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        except (ValueError, TypeError, IndexError, OverflowError) as e:  # ids the tokenizer lacks
            return f"<undecodable: {e}>"

    def _break(self, e: OSError) -> None:
        self.broken = getattr(e, "strerror", None) or str(e)
        log.error(
            "cannot write the rollout archive in %s (%s): archiving stopped; entries are "
            "acknowledged as skipped so training is never held back",
            archive_dir(self.cfg),
            self.broken,
        )
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                pass
            self.writer = None

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if retrying(lambda: self.step(block=1.0), what="archiving rollouts") < self.cfg.bus.read_count:
                stop.wait(GATHER_SECONDS)
        # stopping (after the producers): what gathered since the last read
        retrying(self._drain, what="archiving the last rollouts", give_up_after=STOP_SERVER_WAIT)

    def _drain(self) -> None:
        while self.step(block=0):
            pass

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                log.warning("closing the archive file: %s", e)
        log.info("archived %d groups, skipped %d", self.archived, self.skipped)


def main(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Archive until SIGTERM/SIGINT (exit 0)."""
    return lifecycle.run_role("archiver", lambda: Archiver(cfg))
