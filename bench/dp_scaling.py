"""Data-parallel trainer steps: N ranks under torchrun vs one process, same batches.

Each side runs the real Learner step (consumers/learner.py with consumers/distributed.py)
on the same fixed batches of a Qwen2 model, after one warm-up step, and reports trained
tokens per second; the ratio N-rank / 1-rank is the data-parallel speedup (ideal: N). On a
GPU box each rank takes one GPU (NCCL, bf16 autocast); here, on CPU, gloo and one thread
per rank, so the figure only shows the path works end to end.

    python bench/dp_scaling.py                      # 1 vs 2 ranks, small model (CPU: ~1 min)
    python bench/dp_scaling.py --nproc 8 --hidden 2048 --layers 16 --seq 2048 --rows 64   # 8 GPUs
    python bench/dp_scaling.py --nproc 8 --hidden 4096 --layers 32 --seq 2048 --rows 64 --fsdp
                                                    # the N-rank side sharded (trainer.fsdp)

Prints one line per side (with peak GPU memory per rank on a GPU) and
`ratios: dp_speedup=...x`; with ``--fsdp`` also `memory_per_rank=...x` (sharded N-rank
peak / 1-rank peak; ideal about 1/N for the weights and AdamW state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks of the data-parallel side")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="tokens per sample")
    p.add_argument("--rows", type=int, default=32, help="samples per trainer step")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--micro", type=int, default=4, help="trainer.micro_batch_size")
    p.add_argument("--fsdp", action="store_true", help="shard the N-rank side (FSDP2) instead of replicating")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--out", help=argparse.SUPPRESS)  # a rank's result file (internal)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One side (one process, or every rank under torchrun): time the steps."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from consumers.batch import Batch
    from consumers.distributed import DataParallel
    from consumers.learner import Learner
    from streamer.config import TrainerSection

    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    dp = DataParallel.init(sharded=args.fsdp)
    device = dp.device if dp else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 2)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=args.seq,
    )
    model = AutoModelForCausalLM.from_config(config).to(device)
    cfg = TrainerSection(micro_batch_size=args.micro, ppo_minibatches=1, lr=1e-5)
    learner = Learner(model, cfg, dp=dp)
    g = torch.Generator().manual_seed(1)
    rows, t = args.rows, args.seq
    batch = Batch(
        input_ids=torch.randint(0, 1024, (rows, t), generator=g),
        attention_mask=torch.ones(rows, t, dtype=torch.int64),
        weights=torch.cat([torch.zeros(rows, t // 2), torch.ones(rows, t - 1 - t // 2)], 1),
        sampler_logp=-torch.rand(rows, t - 1, generator=g),
        advantages=torch.randn(rows, generator=g),
    )
    learner.train_step(batch)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        learner.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if dp is None or dp.rank == 0:
        tokens = args.steps * batch.num_tokens
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        result = {"seconds": seconds, "tokens": tokens, "device": str(device), "peak_bytes": peak}
        Path(args.out).write_text(json.dumps(result))
    if dp is not None:
        dp.close(clean=True)


def side(args: argparse.Namespace, nproc: int, out: Path) -> dict:
    skip = ("nproc", "out", "quick", "fsdp")
    own = [f"--{k}={v}" for k, v in vars(args).items() if k not in skip and v is not None]
    own += ["--fsdp"] if args.fsdp and nproc > 1 else []
    script = [str(Path(__file__).resolve()), *own, f"--out={out}"]
    cmd = [sys.executable, *script]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *script,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "STREAMER_DP_WORKER": "1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = parse(argv)
    if os.environ.get("STREAMER_DP_WORKER"):
        worker(args)
        return 0
    if args.quick:
        args.hidden, args.layers, args.seq, args.rows, args.steps = 64, 1, 32, 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        one = side(args, 1, Path(tmp) / "one.json")
        many = side(args, args.nproc, Path(tmp) / "many.json")
    kind = "sharded" if args.fsdp else "replicated"
    for name, r in (
        (f"1 rank  ({one['device']})", one),
        (f"{args.nproc} ranks {kind} ({many['device']})", many),
    ):
        peak = f", peak {r['peak_bytes'] / 2**30:.2f} GiB per rank" if r["peak_bytes"] else ""
        print(
            f"{name:34s} {r['tokens'] / r['seconds']:>12,.0f} trained tokens/s  ({r['seconds']:.2f}s{peak})"
        )
    speedup = (many["tokens"] / many["seconds"]) / (one["tokens"] / one["seconds"])
    line = f"ratios: dp_speedup={speedup:.2f}x (ideal {args.nproc}x)"
    if args.fsdp and one["peak_bytes"]:
        line += f"  memory_per_rank={many['peak_bytes'] / one['peak_bytes']:.2f}x"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
