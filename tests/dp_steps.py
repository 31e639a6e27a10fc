"""K learner steps on fixed batches, on one device or as one rank under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 tests/dp_steps.py OUT_DIR [fsdp] [tokens]

Rank 0 writes OUT_DIR/metrics.json (per-step metrics) and OUT_DIR/weights.safetensors;
tests/test_distributed.py compares them with :func:`run` on one device (``tokens``: the
ranks take token-budget micro-batches, one device whole rows: the same gradient).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_data import make_group

from consumers.batch import collate
from consumers.distributed import DataParallel
from consumers.learner import Learner
from streamer import demo
from streamer.config import TrainerSection

STEPS = 3
CFG = TrainerSection(groups_per_step=5, ppo_minibatches=3, micro_batch_size=3, lr=1e-3, warmup_steps=0)
TOKENS = 19  # micro_batch_tokens under "tokens": 1 or 2 rows of 9-10 tokens; ranks run 2 or 3 passes


def batches() -> list:
    """STEPS batches of 5 groups x 4 samples: minibatches of 7, 7 and 6 rows (uneven shards)."""
    rng = random.Random(11)
    out = []
    for _ in range(STEPS):
        groups = [make_group(rng, rewards=(1.0, 0.0, rng.random(), 1.0)) for _ in range(5)]
        out.append(collate(groups))
    return out


def run(
    dp: DataParallel | None = None, cfg: TrainerSection = CFG
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    learner = Learner(demo.build_model(seed=0), cfg, dp=dp)
    metrics = [learner.train_step(b) for b in batches()]
    full = learner.publishable.state_dict()  # sharded: the full weights gathered on rank 0
    state = {k: v.detach().clone().contiguous() for k, v in full.items()}
    return metrics, state


if __name__ == "__main__":
    torch.set_num_threads(1)
    flags = sys.argv[2:]
    dp = DataParallel.init(sharded="fsdp" in flags)
    tokens = msgspec.structs.replace(CFG, micro_batch_tokens=TOKENS)
    metrics, state = run(dp, tokens if "tokens" in flags else CFG)
    if dp is None or dp.rank == 0:
        out = Path(sys.argv[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics))
        save_file(state, out / "weights.safetensors")  # clones: tied weights are two tensors here
    if dp is not None:
        dp.leave()
