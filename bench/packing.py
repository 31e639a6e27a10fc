"""Token-budget micro-batches vs padding: trained tokens/s of the trainer step on a length mix.

One batch of samples whose lengths are spread log-uniformly over 32-2,048 tokens (the mix
of multi-turn episodes) is trained by the real ``Learner.train_step`` three ways, on the
same model and weights, steps interleaved so that load from elsewhere hits every side:

- padded:   ``micro_batch_size`` rows per micro-batch, each padded to its longest row;
- bucketed: ``micro_batch_tokens`` = the padded side's bound (rows x the longest length),
            rows sorted by length and filled up to it, padded, not packed;
- packed:   the same budget, rows end to end without padding (position-id packing:
            transformers' block-diagonal mask on sdpa/eager, varlen on flash-attention).

    python bench/packing.py                  # a 3.3M-parameter Qwen2, CPU (minutes)
    python bench/packing.py --device cuda    # a GPU box
    python bench/packing.py --quick          # a tiny model and 32-256 tokens (the smoke test)

Prints per side the tokens that go through the model (padding included), seconds per step
and trained tokens/s, then
``ratios: packed_vs_padded=...x bucketed_vs_padded=...x``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from consumers.batch import Batch, collate
from consumers.learner import Learner
from streamer.config import TrainerSection

VOCAB = 512
SIDES = ("padded", "bucketed", "packed")


def length_mix(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """``n`` total lengths log-uniform in [lo, hi], the longest always present."""
    lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n - 1)]
    return [hi, *lengths]


def make_batch(rng: random.Random, lengths: list[int], group_size: int) -> Batch:
    """Groups of ``group_size`` samples of the total ``lengths``, a prompt shared within a group."""
    groups = []
    for i in range(0, len(lengths), group_size):
        totals = lengths[i : i + group_size]
        prompt = rng.randint(8, min(64, min(totals) // 2))
        completions = [total - prompt for total in totals]
        groups.append(C.random_group(i, rng, prompt=prompt, completions=completions, vocab=VOCAB))
    return collate(groups)


def learner_for(side: str, model, *, rows: int, budget: int) -> Learner:
    tokens = 0 if side == "padded" else budget
    learner = Learner(model, TrainerSection(lr=1e-6, micro_batch_size=rows, micro_batch_tokens=tokens))
    if side == "bucketed":
        learner.packing = False
    elif side == "packed" and not learner.packing:
        raise SystemExit("this model's attention does not keep packed rows apart: nothing to compare")
    return learner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32, help="samples per step (groups of 4)")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=4, help="padded side: rows per micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="measured steps per side (after one warm-up)")
    smoke = dict(hidden=64, layers=1, samples=8, max_len=256, repeats=1)
    args = C.parse_args(ap, argv, quick="a tiny model and 32-256 tokens (the smoke test)", **smoke)
    dev = torch.device(args.device)
    rng = random.Random(0)
    batch = make_batch(rng, length_mix(rng, args.samples, args.min_len, args.max_len), group_size=4)
    budget = args.rows * args.max_len  # the padded side's bound on tokens per micro-batch
    learners = {}
    for side in SIDES:  # one model each, same initial weights; lr tiny: every step the same work
        heads, kv_heads = max(args.hidden // 32, 1), max(args.hidden // 64, 1)
        model = C.qwen2(
            vocab=VOCAB,
            hidden=args.hidden,
            layers=args.layers,
            seq=args.max_len,
            heads=heads,
            kv_heads=kv_heads,
            tie=True,
        ).to(dev)
        learners[side] = learner_for(side, model, rows=args.rows, budget=budget)
    params = sum(p.numel() for p in learners["padded"].model.parameters())
    real = int(batch.attention_mask.sum())
    print(
        f"device {dev}, torch threads {torch.get_num_threads()}, model {params / 1e6:.1f}M params, "
        f"{batch.size} samples of {args.min_len}-{args.max_len} tokens ({real} real, "
        f"{batch.size * args.max_len} padded to the longest), {batch.num_tokens} trained tokens/step; "
        f"padded: {args.rows} rows per micro-batch, budget {budget} tokens",
        flush=True,
    )
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats + 1):
        for side in C.alternate(SIDES, repeat):
            C.sync(dev)
            t0 = time.perf_counter()
            learners[side].train_step(batch)
            C.sync(dev)
            if repeat:  # the first round warms up
                seconds[side].append(time.perf_counter() - t0)
    rows = []
    lengths = batch.attention_mask.sum(-1)
    for side in SIDES:
        micros = learners[side].micro_batches(batch)
        through = [
            int(lengths[ix].sum()) if side == "packed" else len(ix) * int(lengths[ix].max()) for ix in micros
        ]
        s = C.median(seconds[side])
        rows.append([side, len(micros), sum(through), s, batch.num_tokens / s])
    C.print_table(["side", "micro-batches", "tokens through the model", "s/step", "trained tok/s"], rows)
    pad = C.median(seconds["padded"])
    C.print_ratios(
        {
            "packed_vs_padded": pad / C.median(seconds["packed"]),
            "bucketed_vs_padded": pad / C.median(seconds["bucketed"]),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
