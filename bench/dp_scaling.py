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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C


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
    p.add_argument("--out", help=argparse.SUPPRESS)  # a rank's result file (internal)
    smoke = dict(hidden=64, layers=1, seq=32, rows=8, steps=1)
    return C.parse_args(p, argv, quick="tiny sizes (the smoke test)", **smoke)


def worker(args: argparse.Namespace) -> None:
    """One side (one process, or every rank under torchrun): time the steps."""
    import torch

    from consumers.distributed import DataParallel
    from consumers.learner import Learner
    from streamer.config import TrainerSection

    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    dp = DataParallel.init(sharded=args.fsdp)
    device = dp.device if dp else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads = max(args.hidden // 64, 2)
    model = C.qwen2(vocab=1024, hidden=args.hidden, layers=args.layers, seq=args.seq, heads=heads)
    cfg = TrainerSection(micro_batch_size=args.micro, ppo_minibatches=1, lr=1e-5)
    learner = Learner(model.to(device), cfg, dp=dp)
    batch = C.random_batch(args.rows, args.seq, vocab=1024, prompt=args.seq // 2)
    seconds, _ = C.train_steps(learner, batch, args.steps)
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
    torchrun = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    )
    cmd = [sys.executable, *torchrun, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(C.ROOT), "STREAMER_DP_WORKER": "1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = parse(argv)
    if os.environ.get("STREAMER_DP_WORKER"):
        worker(args)
        return 0
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
    ratios = {"dp_speedup": speedup}
    if args.fsdp and one["peak_bytes"]:
        ratios["memory_per_rank"] = many["peak_bytes"] / one["peak_bytes"]
    C.print_ratios(ratios, goals={"dp_speedup": f"ideal {args.nproc}x"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
