"""GPU checks: the CUDA paths the CPU suite cannot exercise, in one short run on a GPU box.

    python bench/gpu_check.py                  # a CUDA box (28 s on an H200)
    python bench/gpu_check.py --device cpu     # the same checks on CPU (a dry run)

1. precision: each accepted (model.dtype, trainer.precision) pair trains 3 steps of the
   demo model on the device: float32 master weights, finite, most of them moved; float16
   with a GradScaler; a NaN gradient skips the step (counted), weights untouched.
2. sampling consistency: the local sampler on the device in float32: the on-policy
   importance weight is 1 (atol 1e-5) at temperature 0.7. Then a bfloat16 sampler against
   the trainer's bfloat16 autocast: the train/mismatch_kl a half-precision engine shows.
3. trainer step throughput of a 141M-parameter Qwen2 (32k vocab, hidden 768, 12 layers;
   16 rows of 1024 tokens): float32 vs bfloat16 autocast, trained tokens/s and peak memory.
4. vLLM (when its virtualenv exists: ``python3 dev.py vllm`` builds it, the CUDA build on a
   GPU box): a server on the demo engine model in bfloat16, its sampled log-probs against a
   bfloat16 forward pass here (max error and k3 KL), a bfloat16 version written as the
   trainer writes it for vLLM (untied), reloaded through the vllm profile (seconds), and
   the log-probs after it against the new weights. ``--no-vllm`` skips it.

One `ok`/`FAIL` line per check, then `ratios: bf16_over_fp32_tokens_per_s=...x`; exit 1
if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from consumers.batch import collate
from consumers.learner import Learner
from producers.render import Renderer
from producers.samplers import LocalSampler
from schemas import TrajectoryGroup
from streamer import demo
from streamer.config import TrainerSection

T = 0.7
failed: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failed.append(name)


def prompts(n: int, start: int = 0) -> list[list[int]]:
    """Prompt token ids of ``n`` of the demo's training rows from ``start``."""
    renderer = Renderer(demo.tokenizer())
    return [renderer.render(row) for row in demo.rows("train")[start : start + n]]


def groups(model, n: int = 4, seed: int = 0) -> list[TrajectoryGroup]:
    """n demo groups sampled by ``model`` where it lives, rewards alternating 0/1."""
    tok = demo.tokenizer()
    sampler = LocalSampler(model, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    out = []
    for i, prompt in enumerate(prompts(n, seed)):
        done = sampler.sample(prompt, n=8, temperature=T, top_p=1.0, max_new_tokens=6, seed=seed + i)
        out.append(C.sampled_group(i, prompt, done))
    return out


def precision(dev: torch.device) -> None:
    cases = [  # (weights dtype loaded, trainer.precision)
        (torch.float32, "float32"),
        (torch.float32, "auto"),
        (torch.float32, "bfloat16"),
        (torch.float32, "float16"),
        (torch.bfloat16, "auto"),
        (torch.float16, "auto"),
    ]
    batch = collate(groups(demo.build_model(0).to(dev)))
    for loaded, setting in cases:
        model = demo.build_model(0).to(loaded).to(dev)
        learner = Learner(model, TrainerSection(lr=1e-3, precision=setting, ppo_minibatches=2), temperature=T)
        before = [p.detach().clone() for p in model.parameters()]
        metrics = [learner.train_step(batch) for _ in range(3)]
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        moved = sum(int((a != b).sum()) for a, b in zip(before, model.parameters()))
        total = sum(p.numel() for p in model.parameters())
        master = all(p.dtype == torch.float32 for p in model.parameters())
        skipped = sum(m["optimizer_steps_skipped"] for m in metrics)
        scaler = learner.precision.scaler is not None
        check(
            f"precision {str(loaded).removeprefix('torch.')}/{setting}",
            finite and master and moved > total // 2 and skipped == 0,
            f"compute {str(learner.precision.dtype).removeprefix('torch.')}, scaler={scaler}, "
            f"{moved}/{total} weights moved, loss {metrics[-1]['loss']:+.4f}, skipped {skipped:.0f}",
        )
    for setting in ("bfloat16", "float16"):
        model = demo.build_model(0).to(dev)
        learner = Learner(model, TrainerSection(lr=1e-3, precision=setting), temperature=T)
        before = [p.detach().clone() for p in model.parameters()]
        poisoned = batch.replace(advantages=torch.full_like(batch.advantages, float("nan")))
        m = learner.train_step(poisoned)
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        after = learner.train_step(batch)
        check(
            f"precision {setting}: a NaN gradient skips the step",
            m["optimizer_steps_skipped"] == 1.0 and same and after["optimizer_steps_skipped"] == 0.0,
            f"skipped {m['optimizer_steps_skipped']:.0f}, weights untouched {same}, next step applied",
        )


def log_weights(model, precision: str) -> torch.Tensor:
    """The log importance weights (trainer's log-probs at ``precision`` minus the sampler's)
    of the trained tokens of 6 groups ``model`` sampled."""
    learner = Learner(copy.deepcopy(model), TrainerSection(precision=precision), temperature=T)
    batch, _ = learner.prepare(collate(groups(model, n=6)).to(learner.device))
    return (batch.prox_logp - batch.sampler_logp)[batch.weights > 0]


def consistency(dev: torch.device) -> None:
    err = float((log_weights(demo.build_model(0).to(dev), "float32").exp() - 1).abs().max())
    check("on-policy importance weight is 1 at T=0.7 (float32)", err <= 1e-5, f"max |w-1| {err:.2e}")
    if dev.type == "cuda" and torch.cuda.is_bf16_supported():
        d = log_weights(demo.build_model(0).to(torch.bfloat16).to(dev), "auto")
        k3 = float((d.exp() - 1 - d).mean())
        check(
            "bfloat16 sampler vs bfloat16-autocast trainer",
            k3 < 1e-2,
            f"mismatch_kl {k3:.2e}, max |log w| {float(d.abs().max()):.3f} (what train/mismatch_kl shows)",
        )


def throughput(dev: torch.device, *, hidden: int, layers: int, seq: int, rows: int) -> float:
    """bfloat16-autocast over float32 trained tokens/s."""
    results = {}
    for setting in ("float32", "bfloat16"):
        model = C.qwen2(vocab=32000, hidden=hidden, layers=layers, seq=seq, heads=hidden // 64).to(dev)
        params = sum(p.numel() for p in model.parameters())
        learner = Learner(model, TrainerSection(micro_batch_size=4, lr=1e-5, precision=setting))
        batch = C.random_batch(rows, seq, vocab=32000, prompt=seq // 4, logp=-10.0)
        steps = 3
        seconds, m = C.train_steps(learner, batch, steps)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
        results[setting] = steps * batch.num_tokens / seconds
        check(
            f"throughput {setting}",
            all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            f"{params / 1e6:.0f}M params, {results[setting]:,.0f} trained tokens/s, "
            f"{seconds / steps:.3f} s/step, peak {peak:.1f} GiB, loss {m['loss']:+.4f}",
        )
        del model, learner
    return results["bfloat16"] / results["float32"]


def vllm_section(dev: torch.device, workdir: Path) -> None:
    """A real vLLM server: log-probs of the served weights, then a reloaded version's."""
    from producers import engines
    from producers.remote_sampler import RemoteSampler
    from streamer import vllm_server, weights
    from streamer.server import free_port

    if vllm_server.python() is None:
        print("skip vllm: no vLLM virtualenv (python3 dev.py vllm)", flush=True)
        return
    tok, served = demo.tokenizer(), prompts(4)
    model_dir = demo.save_for_engine(workdir / "model", seed=0)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    server = vllm_server.VllmServer(model_dir, log_path=workdir / "vllm.log", port=free_port(), dtype=dtype)
    server.start()
    try:
        ready = server.wait_ready(served[0], timeout=600)
        check("vllm: first completion", True, f"{ready:.0f}s after start ({dtype})")
        sampler = RemoteSampler(
            base_url=server.url, model=str(model_dir), stop_ids=[tok.eos_token_id], engine=engines.Vllm()
        )

        def worst(model) -> tuple[float, float]:
            errs, kls = [], []
            for p in served:
                for c in sampler.sample(p, n=4, temperature=1.0, top_p=1.0, max_new_tokens=4):
                    ids = torch.tensor([p + list(c.token_ids)], device=dev)
                    half = dtype != "float32"
                    with torch.no_grad(), torch.autocast(dev.type, dtype=getattr(torch, dtype), enabled=half):
                        logits = model(input_ids=ids).logits[0, :-1].float()
                    local = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0][len(p) - 1 :].cpu()
                    engine = torch.tensor(c.logprobs)
                    errs.append(float((engine - local).abs().max()))
                    kls.append(float((torch.exp(local - engine) - (local - engine) - 1).mean()))
            return max(errs), sum(kls) / len(kls)

        base = demo.build_model(0, **demo.ENGINE_SIZE, tie=False).to(dev).eval()
        err, kl = worst(base)
        tol = 1e-4 if dtype == "float32" else 0.1
        check("vllm: log-probs of the served weights", err <= tol, f"max error {err:.2e}, k3 KL {kl:.2e}")
        new = demo.build_model(7, **demo.ENGINE_SIZE, tie=False).to(dev).eval()
        weights.write_version(new, workdir / "weights", 1, dtype=getattr(torch, dtype), untie=True)
        start = time.perf_counter()
        sampler.load_weights(weights.version_dir(workdir / "weights", 1))
        seconds = time.perf_counter() - start
        err, kl = worst(new)
        check(
            "vllm: a reloaded version",
            err <= tol,
            f"reload {seconds:.2f}s; max error {err:.2e}, k3 KL {kl:.2e}",
        )
        sampler.close()
    except Exception as e:  # the engine's own failure is a failed check, with its log's tail
        check("vllm", False, f"{type(e).__name__}: {e}\n{server.tail()}")
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--no-vllm", action="store_true", help="skip the real-engine section")
    smoke = dict(hidden=64, layers=1, seq=32, rows=4)
    args = C.parse_args(ap, argv, quick="a tiny throughput model (the smoke test)", **smoke)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {dev} ({name}), torch {torch.__version__}", flush=True)
    precision(dev)
    consistency(dev)
    ratio = throughput(dev, hidden=args.hidden, layers=args.layers, seq=args.seq, rows=args.rows)
    if not args.no_vllm and not args.quick:
        with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as workdir:
            vllm_section(dev, Path(workdir))
    print(f"{len(failed)} failed: {', '.join(failed)}" if failed else "all ok")
    print(f"ratios: bf16_over_fp32_tokens_per_s={ratio:.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
