"""The trainer's overhead: steps fed from the stream vs the same steps in a bare torch loop.

The trainer is the real one (consumers.trainer.Trainer, in process): it reads
TrajectoryGroups from an embedded Valkey, filters and collates them in its feed thread,
trains, writes and publishes the weights of every version, publishes metrics and
checkpoints every 10 steps. The bare loop is plain torch on the same tensors: each batch
the trainer is handed is first trained by a second model (same initial weights, same
objective and optimizer, so the same work) in a few lines of torch — proximal forward,
minibatch updates, AdamW — and timed. Pairing the two step by step in one process makes
the ratio robust to load from elsewhere on a shared machine: a burst slows both sides of
the same step. The version writer is drained before each bare step, so the trainer's
weight writing is counted in full instead of overlapping the bare step (a conservative
figure: in normal running the writer overlaps the next step).

    python bench/trainer_overhead.py            # ~3M-parameter model, CPU (well < 2 minutes)
    python bench/trainer_overhead.py --check    # exit 1 when the ratio is over 1.10

Prints wall and CPU seconds per step of both and the ratio (goal <= 1.10).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C
import torch

from consumers import losses
from consumers import trainer as T
from consumers.learner import BETAS, Learner
from schemas import MetricsEvent, TrajectoryGroup
from streamer.bus import entry, entry_event
from streamer.config import RunConfig, replace
from streamer.connection import connect
from streamer.keys import Keys
from streamer.server import EmbeddedServer

GOAL = 1.10
VOCAB = 512


def build_model(seed: int):
    return C.qwen2(vocab=VOCAB, hidden=256, layers=4, seq=256, heads=8, kv_heads=4, tie=True, seed=seed)


def make_groups(n: int, *, group_size: int, completion: int, seed: int) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    return [
        C.random_group(
            i,
            rng,
            prompt=rng.randint(12, 24),
            completions=[rng.randint(completion // 2, completion) for _ in range(group_size)],
            vocab=VOCAB,
        )
        for i in range(n)
    ]


class BareLoop:
    """The same step in plain torch, on a model of its own."""

    def __init__(self, cfg: RunConfig):
        self.trainer_cfg = cfg.trainer
        self.model = build_model(cfg.run.seed)
        self.model.train()
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.trainer_cfg.lr,
            betas=BETAS,
            weight_decay=self.trainer_cfg.weight_decay,
        )

    def _logp(self, mb):
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        return losses.token_logprobs(logits, mb.targets)

    def step(self, batch) -> None:
        tc = self.trainer_cfg
        objective = losses.Objective.of(tc)
        with torch.no_grad():
            batch = batch.replace(prox_logp=self._logp(batch))
        for mb in batch.split(tc.ppo_minibatches):
            self.opt.zero_grad(set_to_none=True)
            loss, _ = objective(self._logp(mb), mb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
            self.opt.step()


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def paired_run(cfg: RunConfig, groups) -> tuple[list, list, list[MetricsEvent]]:
    """Per step: (wall, CPU) of the bare step and of the trainer's whole cycle without it."""
    client = connect(cfg.run.redis_url)
    keys = Keys(cfg.run.name)
    pipe = client.pipeline(transaction=False)
    for g in groups:
        pipe.xadd(keys.traj, entry(g))
    pipe.execute()
    learner = Learner(build_model(cfg.run.seed), cfg.trainer)
    trainer = T.Trainer(cfg, client, keys, learner, stop=threading.Event())
    bare, train_step = BareLoop(cfg), learner.train_step
    marks, bare_times = [], []

    def timed_bare(batch) -> None:
        start = now()
        bare.step(batch)
        end = now()
        bare_times.append((end[0] - start[0], end[1] - start[1]))

    def paired_step(batch):
        trainer.versions.drain()  # the previous version's write counts for the trainer
        marks.append(now())
        if len(marks) % 2:  # alternate which side goes first
            timed_bare(batch)
            return train_step(batch)
        metrics = train_step(batch)
        timed_bare(batch)
        return metrics

    learner.train_step = paired_step
    assert trainer.run() == 0
    marks.append(now())  # after the final checkpoint and the last version's publication
    cycles = [(b[0] - a[0] - t[0], b[1] - a[1] - t[1]) for a, b, t in zip(marks, marks[1:], bare_times)]
    events = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    return bare_times, cycles, events


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completion", type=int, default=48, help="max completion tokens")
    p.add_argument("--check", action="store_true", help=f"exit 1 when the ratio exceeds {GOAL}")
    args = p.parse_args(argv)
    T._quiet_transformers()
    total, gps, w = args.steps + args.warmup, args.groups_per_step, args.warmup
    groups = make_groups(total * gps, group_size=args.group_size, completion=args.completion, seed=0)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "valkey") as server:
        cfg = replace(
            RunConfig(),
            run={"name": C.fresh_keys().run, "redis_url": server.url, "data_dir": tmp},
            trainer={"groups_per_step": gps, "steps": total, "max_staleness": 10**6, "lr": 1e-5},
        )
        bare, cycles, events = paired_run(cfg, groups)
    bare, cycles, events = bare[w:], cycles[w:], events[w:]
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    ratio = statistics.median(c[0] / b[0] for b, c in zip(bare, cycles))
    tokens = statistics.mean(e.values["tokens"] for e in events)
    print(
        f"model {sum(p.numel() for p in build_model(0).parameters()) / 1e6:.1f}M params, "
        f"{gps} groups x {args.group_size} samples, {tokens:.0f} trained tokens/step, "
        f"{args.steps} steps after {w} warm-up, torch threads {torch.get_num_threads()}, "
        f"checkpoint every {cfg.trainer.checkpoint_every}"
    )
    print(f"bare torch loop   median {med(bare, 0):.3f} s/step wall  {med(bare, 1):.3f} s/step CPU")
    print(f"trainer (stream)  median {med(cycles, 0):.3f} s/step wall  {med(cycles, 1):.3f} s/step CPU")
    learner = statistics.median(e.values["step_seconds"] - b[0] for e, b in zip(events, bare))
    print(
        f"  of which learner.train_step {learner:.3f}, rest of the cycle {med(cycles, 0) - learner:.3f} "
        f"(weights write+publish {statistics.median(e.values['weight_sync_seconds'] for e in events):.3f}, "
        f"data wait {statistics.median(e.values['data_wait_seconds'] for e in events):.3f})"
    )
    total_ratio = sum(c[0] for c in cycles) / sum(b[0] for b in bare)
    print(f"total-time ratio  {total_ratio:.3f}  (sum over the measured steps, checkpoints included)")
    print(f"overhead ratio    {ratio:.3f}  (median of per-step ratios; goal <= {GOAL})")
    return 1 if args.check and ratio > GOAL else 0


if __name__ == "__main__":
    sys.exit(main())
