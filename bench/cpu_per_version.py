"""CPU per policy version: the whole demo system against a bare in-process GRPO loop.

Two sides, in one run, each a child process of this one so that its CPU (user + system,
every descendant included: ``getrusage(RUSAGE_CHILDREN)`` once it is waited for) is
counted the same way:

    system  ``streamer up --steps N`` with the demo's defaults: the embedded Valkey
            server, trainer, evaluator, exporter, archiver and the producers `up` starts on
            this machine (one per core beside the trainer's: 1 on 2 cores), each its own
            process (one torch thread each, as `up` sets on a 2-core machine)
    bare    one process, one torch thread: the same demo model, LocalSampler, task,
            reward, group filter, collate and Learner, sampling its groups with the very
            model it trains (no weights written, nothing published), and the same greedy
            evaluation every ``eval.eval_every`` versions

The figure is CPU seconds per policy version (one version per train step), system / bare.
The system runs first and may make fewer versions than asked: when every row is set aside
and a last look taught nothing, the producers stop and `up` ends the run. The bare loop then
runs as many versions as the system made; it sets no row aside, so late in a run its steps
draw ever more zero-variance groups: past ``--bare-seconds`` it is stopped and counted up to
the version it reached (its later versions would cost more: the ratio is then an upper bound).
With ``--rounds N`` both sides run N times, alternating which goes first, and the ratio is
of the rounds pooled (each round's is printed too): this VM's speed drifts by 10 % and more
over minutes, which a single system-then-bare run charges to one side.
While the system runs, each process's CPU is read from ``/proc/PID/stat`` every 0.25 s;
the last reading before it exits gives the breakdown by role (the total is exact, the
parts miss at most the last 0.25 s of each process).

    python bench/cpu_per_version.py               # 100 steps each side (~1.5 min here)
    python bench/cpu_per_version.py --steps 500   # the demo's length (~5 min)
    python bench/cpu_per_version.py --quick       # smoke run (10 steps)
    python bench/cpu_per_version.py --model-size 2.4M --steps 500   # where sampling is the work
    python bench/cpu_per_version.py --model-size 2.4M --steps 500 --rounds 2   # system, bare, bare, system
    python bench/cpu_per_version.py --hidden 256 --layers 4   # any wider, deeper demo model

With ``--model-size`` (2.4M = 256 x 4, 298k = 128 x 2) or ``--hidden``/``--layers``
both sides use a demo model of that size (the demo's
tokenizer, task and settings; written once to the work directory), to show how the
system's overhead, fixed per group and per version, weighs against more compute per token.
``--lr`` sets both sides' learning rate; 2.4M runs at 3e-5 unless given one. At
1e-3 (and at 3e-4) every row of the 2.4M model steps aside and the run ends at ~110 (~210)
steps; at 1e-4 every row is solved (all 16 samples right) by ~300. At 3e-5 it trains the 500
steps, held-out accuracy 1.0 from ~180 on, some rows still learnable at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

GOAL = 1.2
# --model-size: (hidden, layers, learning rate or None for the demo's) of the demo model
SIZES = {"298k": (128, 2, None), "2.4M": (256, 4, 3e-5)}


def model_config_file(hidden: int, layers: int, workdir: Path, lr: float | None = None) -> Path:
    """A run config of the demo with a demo model of ``hidden`` x ``layers`` on disk, and
    learning rate ``lr`` (None: the demo's)."""
    import msgspec

    from streamer import demo
    from streamer.config import replace, write_toml

    model = demo.build_model(hidden=hidden, layers=layers, intermediate=2 * hidden)
    model.save_pretrained(workdir / "model")
    demo.tokenizer().save_pretrained(workdir / "model")
    cfg = replace(demo.config(), model={"name_or_path": str(workdir / "model")})
    cfg = cfg if lr is None else replace(cfg, trainer={"lr": lr})
    path = write_toml(workdir / "run.toml", msgspec.to_builtins(cfg))
    print(
        f"model: hidden {hidden}, {layers} layers, {model.num_parameters():,} parameters, lr {cfg.trainer.lr:g}",
        flush=True,
    )
    return path


def system_side(steps: int, producers: int | None, workdir: Path, config: Path | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(C.ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)  # `up` sets it as it would for a user
    argv = [sys.executable, "-m", "streamer", "up", "--steps", str(steps)]
    argv += ["--producers", str(producers)] if producers else []
    argv += ["--data-dir", str(workdir), "--fresh", "--no-progress"]
    argv += ["--config", str(config)] if config else []
    start = time.monotonic()
    code, text, cpu, roles = C.run_by_role(argv, env)
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"streamer up exited {code}:\n{''.join(text.splitlines(keepends=True)[-30:])}")
    groups = _count(r"groups published +(\d+)", text)
    # fewer than asked when the producers found nothing left to teach and `up` ended the run
    versions = _count(r"steps trained +(\d+)", text)
    producers = _count(r"; (\d+) producers?;", text)
    return {
        "cpu": cpu,
        "wall": wall,
        "versions": versions,
        "roles": roles,
        "groups": groups,
        "producers": producers,
    }


def _count(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    if m is None:
        raise SystemExit(f"no {pattern!r} in the output:\n{text[-2000:]}")
    return int(m.group(1))


def bare_side(steps: int, config: Path | None, timeout: float) -> dict:
    """The bare loop for ``steps`` versions; stopped after ``timeout`` seconds (late in a run
    its steps draw ever more zero-variance groups), then counted up to the step it reached."""
    env = {**os.environ, "PYTHONPATH": str(C.ROOT), "OMP_NUM_THREADS": "1"}
    before, start = C.children_cpu(), time.monotonic()
    argv = [sys.executable, __file__, "--bare-child", str(steps)] + (
        ["--config", str(config)] if config else []
    )
    try:
        out = subprocess.run(
            argv, env=env, check=True, capture_output=True, text=True, timeout=timeout
        ).stdout
    except subprocess.TimeoutExpired as e:  # killed and waited for: its CPU is counted
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    done = re.findall(r"step (\d+) groups (\d+)", out)
    if not done:
        raise SystemExit(f"the bare loop finished no step within {timeout:g} s")
    return {
        "cpu": C.children_cpu() - before,
        "wall": time.monotonic() - start,
        "versions": int(done[-1][0]),
        "asked": steps,
        "groups": int(done[-1][1]),
        "stopped": int(done[-1][0]) < steps,
    }


def bare_samples(task, sampler, p, row: dict, *, seed: int, version: int) -> list:
    """One group of the bare loop: render, sample G completions, score and pack each
    (``p``: the producer section of the config)."""
    from producers.rewards import score
    from schemas import Sample

    prompt = task.renderer.render(row)
    comps = sampler.sample(
        prompt,
        n=p.group_size,
        temperature=p.temperature,
        top_p=p.top_p,
        max_new_tokens=p.max_new_tokens,
        seed=seed,
    )
    return [
        Sample.build(
            prompt_ids=prompt,
            completion_ids=c.token_ids,
            logprobs=c.logprobs,
            reward=score(task.reward_fn, row, task.renderer.decode(c.token_ids), c),
            finish_reason=c.finish_reason,
            version=version,
        )
        for c in comps
        if c.token_ids
    ]


def bare_child(steps: int, config: str | None) -> int:
    """The bare loop: sample with the model being trained, filter, collate, step."""
    import torch

    from consumers.batch import collate
    from consumers.filters import GroupFilter
    from consumers.learner import Learner
    from consumers.trainer import _quiet_transformers
    from producers.components import build, load_task
    from producers.rewards import score
    from schemas import TrajectoryGroup
    from streamer import demo
    from streamer.config import load_config, replace

    _quiet_transformers()
    torch.set_num_threads(1)
    cfg = demo.config() if config is None else load_config(config)
    cfg = replace(cfg, trainer={"steps": steps})
    p, tc = cfg.producer, cfg.trainer
    task, sampler = build(cfg)
    learner = Learner(sampler.model, tc)
    keep = GroupFilter.from_config(tc)
    ev = load_task(cfg, dataset="demo", split="eval", tokenizer=task.renderer.tokenizer)
    ev_prompts = [ev.renderer.render(r) for r in ev.rows]
    rng, seed, sampled = random.Random(cfg.run.seed), 0, 0
    for version in range(steps + 1):
        if version % cfg.eval.eval_every == 0:
            for lo in range(0, len(ev_prompts), cfg.eval.batch_size):
                batch = sampler.sample_many(
                    ev_prompts[lo : lo + cfg.eval.batch_size],
                    n=1,
                    temperature=0,
                    max_new_tokens=cfg.eval.max_new_tokens,
                )
                [
                    score(ev.reward_fn, row, ev.renderer.decode(c.token_ids), c)
                    for row, (c,) in zip(ev.rows[lo:], batch)
                ]
        if version == steps:
            break
        groups = []
        while len(groups) < tc.groups_per_step:
            seed += 1
            samples = bare_samples(task, sampler, p, rng.choice(task.rows), seed=seed, version=version)
            group = TrajectoryGroup(
                group_id=str(seed),
                row=0,
                epoch=0,
                producer_id="bare",
                samples=samples,
                policy_version=version,
                created_at=0.0,
            )
            sampled += 1
            if (verdict := keep(group, version=version)).accepted:
                groups.append(verdict.group)
        learner.train_step(collate(groups, std_normalize=tc.std_normalize, std_floor=tc.std_floor))
        print(f"step {version + 1} groups {sampled}", flush=True)
    return 0


def _ratio(system: dict, bare: dict) -> float:
    return (system["cpu"] / system["versions"]) / (bare["cpu"] / bare["versions"])


def _pooled(sides: list[dict]) -> dict:
    """Rounds of one side added up (CPU, versions, groups, wall and each role's CPU)."""
    out: dict = {k: sum(s[k] for s in sides) for k in ("cpu", "versions", "groups", "wall")}
    roles: dict[str, float] = {}
    for s in sides:
        for role, seconds in s.get("roles", {}).items():
            roles[role] = roles.get(role, 0.0) + seconds
    return {**out, "roles": roles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="policy versions (train steps) per side")
    ap.add_argument("--producers", type=int, help="producers of the system side (default: up's)")
    ap.add_argument("--quick", action="store_true", help="10 steps")
    ap.add_argument("--hidden", type=int, help="hidden size of the demo model (default: the demo's)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the demo model, with --hidden")
    ap.add_argument(
        "--model-size", choices=SIZES, help="a named demo model size instead of --hidden/--layers"
    )
    ap.add_argument(
        "--lr",
        type=float,
        help="learning rate of a --model-size/--hidden model (default: the size's, else the demo's)",
    )
    ap.add_argument(
        "--bare-seconds", type=float, default=1800, help="stop the bare loop after this long (default 1800)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of both sides, alternating which runs first; pooled (default 1; 2 = system, bare, bare, system)",
    )
    ap.add_argument("--bare-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_child is not None:
        return bare_child(args.bare_child, args.config)
    if args.quick:
        args.steps = 10
    if args.lr is not None and not (args.model_size or args.hidden):
        ap.error("--lr goes with --model-size or --hidden")
    if args.model_size:
        args.hidden, args.layers, size_lr = SIZES[args.model_size]
        args.lr = args.lr if args.lr is not None else size_lr
    systems: list[dict] = []
    bares: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="streamer-cpu-") as tmp:
        config = model_config_file(args.hidden, args.layers, Path(tmp), args.lr) if args.hidden else None
        for r in range(args.rounds):
            # odd rounds run the bare loop first: a machine whose speed drifts over minutes
            # then favours neither side. The bare loop runs as many versions as the system
            # last made (the system may end early: nothing left to teach); round 0 runs the
            # system first, so there always is one
            order = ("system", "bare") if r % 2 == 0 else ("bare", "system")
            for side in order:
                if side == "system":
                    systems.append(system_side(args.steps, args.producers, Path(tmp) / f"system-{r}", config))
                else:
                    bares.append(bare_side(systems[-1]["versions"], config, args.bare_seconds))
            print(f"round {r + 1} of {args.rounds}: {_ratio(systems[-1], bares[-1]):.2f}x", flush=True)
    system, bare = _pooled(systems), _pooled(bares)
    rows = []
    for name, side in (("system (streamer up)", system), ("bare in-process loop", bare)):
        per, groups = side["cpu"] / side["versions"], side["groups"] / side["versions"]
        rows.append(
            [name, side["versions"], side["cpu"], per, groups, side["cpu"] / side["groups"], side["wall"]]
        )
    heads = ["side", "versions", "CPU s", "CPU s / version", "groups / version", "CPU s / group", "wall s"]
    if args.rounds > 1:
        print(
            f"{args.rounds} rounds pooled; per round: "
            + ", ".join(f"{_ratio(a, b):.2f}x" for a, b in zip(systems, bares))
        )
    C.print_table(heads, rows)
    from streamer.cli.up import cores  # here, not at the top: the bare child imports this file

    print(f"the system ran {systems[-1]['producers']} producer(s) on {cores()} cores")
    print(f"system CPU by process role (from /proc, every {C.ROLE_EVERY:g} s):")
    C.print_roles(system["roles"], system["versions"])
    ratio = _ratio(system, bare)
    name = "cpu_per_version_system_vs_bare"
    # per group drawn: the same ratio without how many groups each side's trajectory drew
    # per version (zero-variance groups, rejected, grow as a run learns)
    per_group = (system["cpu"] / system["groups"]) / (bare["cpu"] / bare["groups"])
    for b in bares:
        if b["stopped"]:  # its later steps would only cost more: the ratio is an upper bound
            print(f"a bare loop was stopped at version {b['versions']} of {b['asked']}")
    C.print_ratios(
        {name: ratio, "cpu_per_group_system_vs_bare": per_group},
        goals={name: f"goal <= {GOAL:g}: {'met' if ratio <= GOAL else 'NOT met'}"},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
