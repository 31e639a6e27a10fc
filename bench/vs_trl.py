"""The demo against TRL's GRPOTrainer at matched settings: CPU seconds and samples to held-out 0.8.

Two sides per seed, each a child process of this one, so that its CPU (user + system, every
descendant included: ``getrusage(RUSAGE_CHILDREN)`` once it is waited for) is counted the
same way:

    streamer  ``streamer up --until-eval 0.8`` of the built-in demo with ``run.seed`` set:
              every role its own process, as a user runs it
    trl       one process, one torch thread: ``trl.GRPOTrainer`` (float32, no gradient
              checkpointing, as the streamer side's trainer) on the same model
              (``streamer.demo.build_model(seed)``), tokenizer, train rows, reward, group
              size G, prompts per version, learning rate and cosine schedule to 0.1 of it
              (over the same optimizer steps), optimizer steps per version (each version's
              completions split in ``ppo_minibatches`` optimizer steps, as the trainer does),
              PPO clip, no KL term, max new tokens and temperature

Both measure held-out accuracy the same way: greedy decoding of the evaluator's held-out
pairs (``producers.samplers.LocalSampler``, ``eval.batch_size`` prompts a batch) scored by
the demo's reward, at version 0 and every ``eval.eval_every`` versions (streamer's
evaluator does it in its own process beside the trainer; the TRL side between steps). Each
side stops at the first evaluation at or above the target: its CPU is the CPU to get
there, start-up and shut-down included. Streamer's trainer goes on while the evaluator
scores a version, so it stops a few versions past it; those are counted in its CPU and
shown as the overshoot.

Per side and seed: CPU s, the version that first scored >= the target, samples generated
to reach it (G x groups sampled by the versions before it: completions the policy that
scored had learnt from), CPU s per trained version. Seeds alternate which side runs
first; ``--rounds`` repeats the seeds (this VM's speed drifts over minutes). The
``ratios:`` line is streamer / TRL of the seeds pooled.

    python bench/vs_trl.py                      # seeds 0 1 2 (~8 min here)
    python bench/vs_trl.py --rounds 2           # each seed twice, the order flipped
    python bench/vs_trl.py --target 0.9
    python bench/vs_trl.py --quick              # smoke run: seed 0, target 0.1, 20 versions

TRL is a bench-only dependency (``pip install -e .[bench]``); without it the script says so
and exits 0 (``--only streamer`` needs none).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

GOAL = 1.2  # streamer's CPU to held-out 0.8 over TRL's


def _first_at(evals: dict[int, float], target: float) -> int | None:
    return min((v for v, a in evals.items() if a >= target), default=None)


# ---------------------------------------------------------------- the streamer side


def streamer_side(seed: int, target: float, steps: int, workdir: Path, overrides: dict) -> dict:
    """``streamer up --until-eval target`` of the demo with ``run.seed = seed`` and
    ``overrides`` (section -> {key: value})."""
    import msgspec

    from streamer import demo
    from streamer.config import replace, write_toml

    cfg = replace(demo.config(), **{**overrides, "run": {**overrides.get("run", {}), "seed": seed}})
    workdir.mkdir(parents=True)
    config = write_toml(workdir / "run.toml", msgspec.to_builtins(cfg))
    env = {**os.environ, "PYTHONPATH": str(C.ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)  # `up` sets it as it would for a user
    argv = [sys.executable, "-m", "streamer", "up", "--config", str(config), "--steps", str(steps)]
    argv += ["--until-eval", str(target), "--data-dir", str(workdir), "--fresh", "--no-progress"]
    code, text, cpu, roles = C.run_by_role(argv, env)
    if code != 0:
        raise SystemExit(f"streamer up exited {code}:\n{text[-3000:]}")
    curve = json.loads((workdir / cfg.run.name / "curve.json").read_text())
    evals = {int(v): a for v, a in curve["eval_accuracy_by_version"].items()}
    groups = {int(v): n for v, n in curve["groups_by_version"].items()}
    reached = _first_at(evals, target)
    g = cfg.producer.group_size
    return {
        "cpu": cpu,
        "versions": int(re.search(r"steps trained +(\d+)", text).group(1)),
        "reached": reached,
        "samples": None if reached is None else g * sum(n for v, n in groups.items() if v < reached),
        "sampled": g * int(re.search(r"groups published +(\d+)", text).group(1)),
        "roles": roles,
    }


# ---------------------------------------------------------------- the TRL side


def trl_side(seed: int, target: float, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(C.ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--trl-child", str(seed), "--target", str(target)]
    argv += ["--steps", str(steps)]
    before = C.children_cpu()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    cpu = C.children_cpu() - before
    if proc.returncode != 0:
        raise SystemExit(
            f"the TRL side exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    evals = {int(v): float(a) for v, a in re.findall(r"^eval (\d+) ([\d.]+)$", proc.stdout, re.M)}
    versions = int(re.search(r"^versions (\d+)$", proc.stdout, re.M).group(1))
    per_version = int(re.search(r"^samples per version (\d+)$", proc.stdout, re.M).group(1))
    reached = _first_at(evals, target)
    return {
        "cpu": cpu,
        "versions": versions,
        "reached": reached,
        "samples": None if reached is None else per_version * reached,
        "sampled": per_version * versions,
    }


def trl_child(seed: int, target: float, steps: int) -> int:
    """GRPOTrainer on the demo, evaluated as streamer's evaluator does; stops at ``target``."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from consumers.trainer import _quiet_transformers
    from producers.components import load_task
    from producers.rewards import score
    from producers.samplers import LocalSampler
    from streamer import demo

    _quiet_transformers()
    cfg = demo.config()
    p, tc, ec = cfg.producer, cfg.trainer, cfg.eval
    tok = demo.tokenizer()
    model = demo.build_model(seed)
    rows = demo.rows("train")
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    ev = load_task(cfg, dataset="demo", split="eval", tokenizer=tok)
    ev_prompts = [ev.renderer.render(r) for r in ev.rows]
    per_version = tc.groups_per_step * p.group_size
    minibatches = tc.ppo_minibatches

    def reward(prompts, completions, answer, **_):
        return [demo.reward({"answer": a}, c[0]["content"]) for c, a in zip(completions, answer, strict=True)]

    def accuracy(model) -> float:
        sampler = LocalSampler(model, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
        right = 0.0
        for lo in range(0, len(ev_prompts), ec.batch_size):
            batch = sampler.sample_many(
                ev_prompts[lo : lo + ec.batch_size], n=1, temperature=0, max_new_tokens=ec.max_new_tokens
            )
            for row, (c,) in zip(ev.rows[lo:], batch):
                right += score(ev.reward_fn, row, ev.renderer.decode(c.token_ids), c)
        model.train()
        return right / len(ev_prompts)

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **_):
            print(f"eval 0 {accuracy(model):.4f}", flush=True)

        def on_step_end(self, args, state, control, model=None, **_):
            version, rest = divmod(state.global_step, minibatches)
            if rest == 0 and version % ec.eval_every == 0:
                acc = accuracy(model)
                print(f"eval {version} {acc:.4f}", flush=True)
                control.should_training_stop = acc >= target or version >= steps

    with tempfile.TemporaryDirectory(prefix="streamer-vs-trl-") as out:
        args = GRPOConfig(
            output_dir=out,
            seed=seed,
            use_cpu=True,
            # TRL's defaults are bf16 autocast and gradient checkpointing, even on a CPU; the
            # streamer side's trainer trains float32 without checkpointing
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            num_generations=p.group_size,
            per_device_train_batch_size=per_version // minibatches,
            steps_per_generation=minibatches,  # one generation a version, split in minibatches
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=0,
            learning_rate=tc.lr,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": tc.min_lr_ratio},
            warmup_steps=tc.warmup_steps,
            max_steps=tc.lr_decay_steps,  # the schedule's length; the callback stops the run
            weight_decay=tc.weight_decay,
            max_grad_norm=tc.grad_clip,
            adam_beta1=0.9,
            adam_beta2=0.999,
            beta=tc.kl_coef,
            epsilon=tc.eps_low,
            epsilon_high=tc.eps_high,
            loss_type="dapo",  # token mean over the minibatch, as trainer.loss_agg "auto" for grpo
            scale_rewards="group" if tc.std_normalize else "none",
            mask_truncated_completions=tc.overlong != "keep",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Evaluate()],
        )
        trainer.train()
        print(f"versions {trainer.state.global_step // minibatches}", flush=True)
        print(f"samples per version {per_version}", flush=True)
    return 0


# ---------------------------------------------------------------- the report


def _overrides(settings: list[str]) -> dict:
    """``["producer.concurrency=8", ...]`` as ``{"producer": {"concurrency": 8}}``."""
    import tomllib

    out: dict = {}
    for text in settings:
        key, _, value = text.partition("=")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = tomllib.loads(f"v = {value}")["v"]
    return out


def _row(name: str, seed: int, s: dict) -> list:
    return [
        name,
        seed,
        s["cpu"],
        "-" if s["reached"] is None else s["reached"],
        "-" if s["samples"] is None else s["samples"],
        s["versions"],
        s["cpu"] / max(1, s["versions"]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=1, help="times each seed runs, alternating the order")
    ap.add_argument("--target", type=float, default=0.8, help="held-out accuracy to reach (default 0.8)")
    ap.add_argument("--steps", type=int, help="versions at most per side (default: the demo's)")
    ap.add_argument("--quick", action="store_true", help="seed 0, target 0.1, at most 20 versions")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of the streamer side's config (a TOML value), e.g. producer.concurrency=8",
    )
    ap.add_argument("--only", choices=("streamer", "trl"), help="run one side (no ratios)")
    ap.add_argument("--trl-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from streamer import demo

    steps = args.steps or demo.STEPS
    if args.trl_child is not None:
        return trl_child(args.trl_child, args.target, steps)
    if args.only != "streamer" and importlib.util.find_spec("trl") is None:
        print("vs_trl: TRL is not installed (pip install -e '.[bench]'): nothing measured")
        return 0
    if args.quick:
        args.seeds, args.target, steps = args.seeds[:1], 0.1, 20
    overrides = _overrides(args.set)
    runs: list[tuple[int, dict, dict]] = []
    streamers: list[dict] = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="streamer-vs-trl-") as tmp:
        for r in range(args.rounds):
            for i, seed in enumerate(args.seeds):
                first = ("streamer", "trl") if (r * len(args.seeds) + i) % 2 == 0 else ("trl", "streamer")
                got = {}
                for side in [s for s in first if args.only in (None, s)]:
                    if side == "streamer":
                        got[side] = streamer_side(
                            seed, args.target, steps, Path(tmp) / f"s{r}-{seed}", overrides
                        )
                    else:
                        got[side] = trl_side(seed, args.target, steps)
                    g = got[side]
                    print(
                        f"round {r + 1} seed {seed} {side}: {g['cpu']:.1f} CPU s, {g['versions']} versions, "
                        f"held-out {args.target:g} at version {g['reached']}, samples {g['samples']}",
                        flush=True,
                    )
                streamers += [got["streamer"]] if "streamer" in got else []
                rows += [_row(side, seed, got[side]) for side in ("streamer", "trl") if side in got]
                if len(got) == 2:
                    runs.append((seed, got["streamer"], got["trl"]))
    t = f"{args.target:g}"
    C.print_table(
        [
            "side",
            "seed",
            f"CPU s to {t}",
            f"version at {t}",
            f"samples to {t}",
            "versions",
            "CPU s / version",
        ],
        rows,
    )
    roles: dict[str, float] = {}
    for s in streamers:
        for role, seconds in s["roles"].items():
            roles[role] = roles.get(role, 0.0) + seconds
    if roles:
        print(f"streamer CPU by process role (from /proc, every {C.ROLE_EVERY:g} s), all runs:")
        C.print_roles(roles, sum(s["versions"] for s in streamers) or 1)
    both = [(s, x) for _, s, x in runs if s["reached"] is not None and x["reached"] is not None]
    print(f"runs where both sides reached {t}: {len(both)} of {len(runs)}")
    for seed, s, x in runs:
        print(
            f"  seed {seed}: CPU {s['cpu'] / x['cpu']:.2f}x, CPU per version "
            f"{(s['cpu'] / s['versions']) / (x['cpu'] / x['versions']):.2f}x; streamer trained "
            f"{s['versions'] - (s['reached'] or 0)} versions past the one that scored {t}"
        )
    if not runs:
        return 0
    ratios = {}
    if both:
        ratios[f"cpu_to_{t}"] = sum(s["cpu"] for s, _ in both) / sum(x["cpu"] for _, x in both)
        ratios[f"samples_to_{t}"] = sum(s["samples"] for s, _ in both) / max(
            1, sum(x["samples"] for _, x in both)
        )
    ratios["cpu_per_version"] = (
        sum(s["cpu"] for _, s, _ in runs) / sum(s["versions"] for _, s, _ in runs)
    ) / (sum(x["cpu"] for _, _, x in runs) / sum(x["versions"] for _, _, x in runs))
    goal = ratios.get(f"cpu_to_{t}")
    C.print_ratios(
        ratios,
        goals={}
        if goal is None
        else {f"cpu_to_{t}": f"goal <= {GOAL:g}: {'met' if goal <= GOAL else 'NOT met'}"},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
