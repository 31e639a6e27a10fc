"""Weight-sync latency: from the trainer's publication of a version to every producer
sampling with it, against the raw safetensors save + load of the same weights.

The trainer's side is the trainer's own publisher (consumers.versions.VersionPublisher,
driven here without training: snapshot the weights, write them as a version directory
with streamer.weights.write_version, XADD the WeightSync in one MULTI with the version
key). The producers are real producer processes (producers.producer.Producer with its
real WeightFollower, admission, leases and publishing) holding the real policy model:
each new version is resolved (path inside weights_dir, manifest's sha256 checked) and loaded into
that model in place. By default their sampling is a fixed latency (``--sample-latency``,
standing in for generation on an accelerator, which would not use these CPU cores);
``--real-sampling`` runs plain `streamer produce` with CPU generation instead.

When each producer has loaded a version is recorded by the producer itself, exactly: in
its process the bench wraps the real ``WeightFollower.load``, and when a load succeeds it
adds (producer, version, the time it returned, its duration) to a stream of the bench's
(a producer loads before the first sample of its next group). Versions go out one at a
time: the next only after every producer has loaded the last. Per version:

    publish   step end -> WeightSync.at (the CPU weights lent to the writer, not copied;
              files written, checked for inf and NaN and hashed (BLAKE3) in one pass,
              piece by piece on every core, renamed into place; not fsynced: checkpoints
              are the durable state)
    notice    WeightSync.at -> the producer starts loading (finishes its current group)
    load      manifest check (+ every piece re-hashed with --verify full) + fit check + the
              file mapped and the model's parameters pointed at it (weight_load_seconds;
              the page faults come in the first forward pass after it: ~10 ms for 390 MB on
              the VM, not counted here, where sampling is paced)
    raw       safetensors save_file of the same tensors + load_file + load_state_dict into
              the model, in this process, after each version (median over all of a model's)

The goals: publish-to-every-producer (WeightSync.at -> last producer loaded) <= 1.5x raw,
and so is the end-to-end figure (step end -> last producer loaded, ``NAME_end``).

    python bench/weight_sync.py                        # demo + ~100M model, 1 and 4 producers
    python bench/weight_sync.py --quick                # smoke run (demo only)
    python bench/weight_sync.py --models big --verify full   # producers re-hash every byte
    python bench/weight_sync.py --models big --versions 10 --producers 1 4 8
    python bench/weight_sync.py --models big --producers 1 --lora 0 16   # LoRA rank 16 vs full

With ``--lora R`` the model is wrapped in a rank-R LoRA adapter (streamer/lora.py): each
version publishes the adapter only (PEFT layout) and the producers, configured with the same
``[model.lora]``, apply it to their base. ``MB/version`` is the version directory's size.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C
import numpy as np
import torch

from consumers import versions
from consumers.versions import VersionPublisher
from producers.samplers import Completion
from schemas import WeightSync
from streamer import demo, disk, weights
from streamer.admission import Admission
from streamer.bus import as_str, entry_event
from streamer.connection import connect
from streamer.keys import Keys

GOAL = 1.5
WAIT = 120.0  # seconds any one wait may take before the bench gives up loudly
START = 600.0  # ... except for producers to start (torch and the model: minutes on a busy machine)


# ---------------------------------------------------------------- models


def big_config(*, hidden: int, layers: int):
    """A Qwen2 config of ~100M parameters at the defaults (16 x 768), demo vocabulary."""
    return demo.model_config(hidden=hidden, layers=layers, heads=hidden // 64, intermediate=hidden * 8 // 3)


def build(kind: str, workdir: Path, args) -> tuple[torch.nn.Module, str]:
    """(the trainer's model, model.name_or_path for the producers: the same initial weights)."""
    if kind == "demo":
        return demo.build_model(0), "demo"
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(big_config(hidden=args.hidden, layers=args.layers))
    path = workdir / "big-model"
    model.save_pretrained(path)
    demo.tokenizer().save_pretrained(path)
    return model, str(path)


# ---------------------------------------------------------------- the producer processes


def loaded_key(keys: Keys) -> str:
    return f"{keys.prefix}:bench-loaded"  # the bench's: (producer, version, at, seconds) per load


class PacedSampler:
    """The producer's local policy model for loading; sampling is a fixed latency."""

    def __init__(self, inner, *, latency: float):
        self.inner, self.latency = inner, latency

    def sample(self, prompt_ids, *, n, **_kw) -> list[Completion]:
        time.sleep(self.latency)
        eos = self.inner.stop_ids[0]
        return [Completion([eos], [-1.0], "stop") for _ in range(n)]

    def load_weights(self, directory: Path) -> None:
        self.inner.load_weights(directory)

    def close(self) -> None:
        self.inner.close()


def producer_child(config: str, producer_id: str, latency: float, *, verify: str) -> int:
    """A producer process: the real Producer loop with a PacedSampler around its model
    (``latency`` < 0: its real sampler), every successful load recorded on loaded_key
    (``verify="none"``: the what-if of loading without any sha256 check; "manifest" and
    "full" are the config's ``weights.verify``, written into the config)."""
    from producers.components import build as build_parts
    from producers.follow import WeightFollower
    from producers.producer import Producer
    from streamer.config import load_config

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if verify == "none":
        weights.resolve = functools.partial(weights.resolve, check_sha=False)
    cfg = demo.config() if config is None else load_config(config)
    client = connect(cfg.require_redis_url(), socket_timeout=cfg.bus.socket_timeout, name=producer_id)
    load, stream = WeightFollower.load, loaded_key(Keys(cfg.run.name))

    def record(version: int, took: float) -> None:
        client.xadd(stream, {"p": producer_id, "v": version, "at": time.time(), "s": took})

    def recorded(follower, sync) -> bool:
        if not load(follower, sync):
            return False
        record(follower.version, follower.last_load_seconds)
        return True

    WeightFollower.load = recorded
    task, sampler = build_parts(cfg)
    sampler = PacedSampler(sampler, latency=latency) if latency >= 0 else sampler
    producer = Producer(cfg, client=client, producer_id=producer_id, task=task, sampler=sampler)
    record(producer.follower.version, 0.0)  # the weights it starts with: up and about to sample
    signal.signal(signal.SIGTERM, lambda *_: producer.stop.set())
    try:
        return producer.run()
    finally:
        producer.close()
        client.close()


def write_config(
    workdir: Path, keys, *, url: str, model: str, lora_rank: int = 0, verify: str = "manifest"
) -> Path:
    model_section: dict = {"name_or_path": model}
    if lora_rank:
        model_section["lora"] = {"rank": lora_rank, "alpha": 2 * lora_rank}
    producer = {
        "group_size": 2,
        "min_group_size": 1,
        "max_new_tokens": 1,
        "reward": "streamer.demo:reward",
        "torch_threads": 1,
        "shutdown_grace": 5.0,
        "defer_after": 0,  # paced groups teach nothing: rows never step aside, the run never ends
        "defer_failed_after": 0,
        "defer_pass_rate": 0,
    }
    return C.write_run_config(
        workdir,
        keys,
        url,
        weights={"verify": "full" if verify == "full" else "manifest"},
        model=model_section,
        bus={"max_unacked": C.WIDE_OPEN},
        producer=producer,
    )


def spawn(config: Path, producer_id: str, args) -> subprocess.Popen:
    log = config.parent / f"{producer_id}.log"
    env = {**os.environ, "PYTHONPATH": str(C.ROOT), "OMP_NUM_THREADS": "1"}
    latency = -1.0 if args.real_sampling else args.sample_latency
    cmd = [__file__, "--producer-child", str(config), producer_id, str(latency), args.verify]
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, *cmd], cwd=config.parent, env=env, stdout=fh, stderr=fh)


# ---------------------------------------------------------------- observing the loads


class Loads:
    """When each producer finished loading each version, and how long the load took (as
    each producer records them on loaded_key)."""

    def __init__(self, client, keys: Keys):
        self.client, self.stream, self.cursor = client, loaded_key(keys), "0-0"
        self.loaded: dict[tuple[str, int], tuple[float, float]] = {}  # (producer, version) -> (at, s)

    def poll(self) -> None:
        for _, entries in self.client.xread({self.stream: self.cursor}, count=10_000, block=50) or []:
            for entry_id, f in entries:
                self.cursor = entry_id
                self.loaded[(as_str(f[b"p"]), int(f[b"v"]))] = (float(f[b"at"]), float(f[b"s"]))

    def wait(self, producers: list[str], version: int, procs, *, timeout: float = WAIT) -> None:
        """Until every producer has loaded ``version``."""
        deadline = time.monotonic() + timeout
        while any((p, version) not in self.loaded for p in producers):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                missing = [p for p in producers if (p, version) not in self.loaded]
                raise SystemExit(f"producers {missing} did not load version {version}")
            self.poll()


# ---------------------------------------------------------------- the measurement


class Clock:
    """Seconds the publisher spends in its parts: the real functions, wrapped with a timer
    in this process only (the producers' processes are untouched). Install once."""

    def __init__(self):
        self.seconds = {"snapshot": 0.0, "save": 0.0, "fsync": 0.0}
        self._wrap(weights, "save", "save")  # serialise + write, checking and hashing as it writes
        self._wrap(versions, "snapshot", "snapshot")
        self._wrap(disk, "fsync", "fsync")  # a version no longer pays it: 0 unless that changes

    def _wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds = dict.fromkeys(out, 0.0)
        return out


def raw_save_load(model, path: Path, published=None) -> tuple[float, float]:
    """Seconds for safetensors save_file of the published tensors, load_file, and the copy
    into the model (what any reload needs): the floor a file-based sync could reach."""
    from safetensors.torch import load_file, save_file

    seen, state = set(), {}
    for name, t in (
        (published or model).state_dict().items()
    ):  # tied tensors once (safetensors refuses aliases)
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state[name] = t
    start = time.perf_counter()
    save_file(state, str(path))
    saved = time.perf_counter()
    model.load_state_dict(load_file(str(path)), strict=False)
    loaded = time.perf_counter()
    path.unlink()
    return saved - start, loaded - saved


def one_version(
    model,
    version: int,
    *,
    publisher: VersionPublisher,
    loads: Loads,
    client,
    keys,
    producers: list[str],
    procs,
    workdir: Path,
    jitter: float,
    clock: Clock,
    published=None,
) -> dict:
    """Publish ``version``, wait until every producer loaded it; its timings."""
    published = published if published is not None else model
    with torch.no_grad():
        for p in model.parameters():  # a different version (as a step would make it)
            if p.requires_grad:  # with LoRA: the adapter only
                p.add_(1e-6)
    time.sleep(random.uniform(0.0, jitter))  # out of phase with the producers' groups
    clock.take()
    submitted = time.time()
    publisher.submit(published, version=version, step=version)
    publisher.drain()
    _, fields = client.xrevrange(keys.policy, count=1)[0]
    sync = entry_event(fields, WeightSync)
    assert sync.version == version, (sync.version, version)
    loads.wait(producers, version, procs)
    done = {p: loads.loaded[(p, version)][0] for p in producers}
    took = {p: loads.loaded[(p, version)][1] for p in producers}
    last = max(done.values())
    parts = clock.take()
    raw_save, raw_load = raw_save_load(model, workdir / "raw.safetensors", published)
    vdir = weights.version_dir(publisher.root, version)
    return {
        "bytes": float(sum(f.stat().st_size for f in vdir.iterdir())) if vdir.exists() else float("nan"),
        **parts,
        "publish": sync.at - submitted,
        "path": sync.at - submitted + max(took.values()),
        "notice": max(done[p] - took[p] - sync.at for p in producers),
        "load": max(took.values()),
        "xadd_to_all": last - sync.at,
        "end_to_all": last - submitted,
        "raw_save": raw_save,
        "raw_load": raw_load,
        "raw": raw_save + raw_load,
    }


def measure(
    kind: str, *, url: str, workdir: Path, args, clock: Clock, lora_rank: int = 0
) -> dict[int, list[dict]]:
    """Per producer count: the timings of each measured version (for one model)."""
    workdir.mkdir(parents=True)
    model, source = build(kind, workdir, args)
    published = model
    if lora_rank:
        from streamer import lora
        from streamer.config import LoraSection

        model = lora.apply(model, LoraSection(rank=lora_rank, alpha=2.0 * lora_rank))
        published = lora.AdapterView(model)
    keys = C.fresh_keys("wsync")
    client = C.bench_client(url)
    config = write_config(workdir, keys, url=url, model=source, lora_rank=lora_rank, verify=args.verify)
    Admission(client, keys, max_staleness=0, groups_per_step=1).publish_limits(
        max_staleness=0, groups_per_step=C.WIDE_OPEN
    )
    publisher = VersionPublisher(
        client, keys, root=workdir / keys.run / "weights", keep_versions=3, protect=lambda: -1
    )
    publisher.publish_now(published, version=0, step=0)  # as the trainer does at start
    loads, procs, producers, version = Loads(client, keys), [], [], 0
    results: dict[int, list[dict]] = {}
    try:
        for count in sorted(args.producers):
            new = [f"p{i}" for i in range(len(producers), count)]
            procs += [spawn(config, p, args) for p in new]
            producers += new
            loads.wait(producers, version, procs, timeout=START)  # all up, sampling the newest version
            for i in range(args.warmup + args.versions):
                version += 1
                res = one_version(
                    model,
                    version,
                    publisher=publisher,
                    loads=loads,
                    client=client,
                    keys=keys,
                    producers=producers,
                    procs=procs,
                    workdir=workdir,
                    jitter=args.sample_latency,
                    clock=clock,
                    published=published,
                )
                if i >= args.warmup:
                    results.setdefault(count, []).append(res)
            print(f"  {kind}: {count} producer(s) done", flush=True)
        faults = float("nan") if lora_rank else first_forward(model, publisher.root, version)
    finally:
        C.stop_processes(procs)
        publisher.close()
        C.drop_run(client, keys)
        client.close()
    return {"params": sum(p.numel() for p in model.parameters()) / 1e6, "faults": faults, **results}


def first_forward(model, root: Path, newest: int, reps: int = 6) -> float:
    """Median extra seconds of the first forward pass after a version is loaded into a CPU
    model over the next one: the page faults that a load which maps the file leaves to the
    first sample (the producers here never touch their weights: sampling is paced)."""
    fresh = copy.deepcopy(model).eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    extra = []
    with torch.no_grad():
        fresh(ids)
        for i in range(reps):
            weights.load_into(fresh, weights.version_dir(root, newest - i % 2), mapped=True)
            start = time.perf_counter()
            fresh(ids)
            first = time.perf_counter() - start
            start = time.perf_counter()
            fresh(ids)
            extra.append(first - (time.perf_counter() - start))
    return C.median(extra)


# ---------------------------------------------------------------- report


def p95(xs: list[float]) -> float:
    return float(np.percentile(xs, 95))


def report(all_results: dict[str, dict], args) -> None:
    latency, parts, ratios, goals = [], [], {}, {}
    for kind, res in all_results.items():
        every = [r for count in args.producers for r in res[count]]
        raw = {k: C.median([r[k] for r in every]) for k in ("raw", "raw_save", "raw_load")}
        for count in sorted(args.producers):
            runs = res[count]
            med = {k: C.median([r[k] for r in runs]) for k in runs[0]}
            name = f"{kind} {res['params']:.1f}M"
            latency.append(
                [
                    name,
                    count,
                    len(runs),
                    med["xadd_to_all"],
                    p95([r["xadd_to_all"] for r in runs]),
                    med["end_to_all"],
                    p95([r["end_to_all"] for r in runs]),
                    raw["raw"],
                    med["xadd_to_all"] / raw["raw"],
                    med["bytes"] / 1e6,
                ]
            )
            parts.append(
                [
                    name,
                    count,
                    *(med[k] for k in ("publish", "snapshot", "save", "fsync")),
                    raw["raw_save"],
                    med["notice"],
                    med["load"],
                    raw["raw_load"],
                ]
            )
            named = ((f"{kind}_{count}p", "xadd_to_all"), (f"{kind}_{count}p_path", "path"))
            for ratio, key in (*named, (f"{kind}_{count}p_end", "end_to_all")):
                ratios[ratio] = med[key] / raw["raw"]
                goals[ratio] = f"goal <= {GOAL:g}: {'met' if ratios[ratio] <= GOAL else 'NOT met'}"
    mode = f"sampling paced at {args.sample_latency * 1e3:.0f} ms/group"
    mode = "CPU generation" if args.real_sampling else mode
    verify = {
        "manifest": ", producers verify by the manifest",
        "full": ", producers re-hash every byte (verify=full)",
        "none": ", producers NOT checking sha256 (what-if)",
    }[args.verify]
    print(
        f"seconds; medians over {args.versions} versions after {args.warmup} warm-up ({mode}{verify}); "
        "raw: median over all of the model's versions"
    )
    C.print_table(
        [
            "model",
            "producers",
            "versions",
            "xadd->all",
            "p95",
            "end->all",
            "p95",
            "raw",
            "xadd->all/raw",
            "MB/version",
        ],
        latency,
    )
    print(
        "where the time goes (publish: this process's publisher, timed part by part; notice and "
        "load: slowest producer's)"
    )
    C.print_table(
        [
            "model",
            "producers",
            "publish",
            "snapshot",
            "save",
            "fsync",
            "raw save",
            "notice",
            "load",
            "raw load",
        ],
        parts,
    )
    print(
        "legend: NAME = xadd->all / raw (publication to every producer loaded); NAME_path = (publish + load) / raw, "
        "the data path without the wait for the group in flight; NAME_end = end->all / raw, from "
        "the end of the step to every producer on the new version"
    )
    for kind, res in all_results.items():
        if not math.isnan(res["faults"]):
            print(
                f"{kind}: the first forward pass after a load takes {res['faults'] * 1e3:.1f} ms more than "
                "the next (page faults of the mapped file: the first sample pays them, not load above)"
            )
    C.print_ratios(ratios, goals=goals)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    ap.add_argument("--models", nargs="+", choices=["demo", "big"], default=["demo", "big"])
    ap.add_argument("--producers", nargs="+", type=int, default=[1, 4], help="producer counts")
    ap.add_argument("--versions", type=int, default=15, help="measured versions per producer count")
    ap.add_argument("--warmup", type=int, default=1, help="versions not measured per producer count")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size of the big model")
    ap.add_argument("--layers", type=int, default=16, help="layers of the big model")
    ap.add_argument("--sample-latency", type=float, default=0.05, help="seconds per paced group")
    ap.add_argument(
        "--real-sampling",
        action="store_true",
        help="plain `streamer produce` (CPU generation) instead of paced sampling",
    )
    ap.add_argument(
        "--verify",
        choices=["manifest", "full", "none"],
        default="manifest",
        help='producers\' weights.verify: "manifest" (default), "full" (re-hash every byte), or '
        '"none" (what-if: resolve\'s check_sha=False)',
    )
    ap.add_argument(
        "--lora",
        nargs="+",
        type=int,
        default=[0],
        help="LoRA ranks to measure each model at (0 = full weights)",
    )
    ap.add_argument("--no-verify", dest="verify", action="store_const", const="none", help="= --verify none")
    ap.add_argument(
        "--producer-child", nargs=4, metavar=("CONFIG", "ID", "LATENCY", "VERIFY"), help=argparse.SUPPRESS
    )
    smoke = dict(models=["demo"], producers=[1, 2], versions=2)
    return C.parse_args(ap, argv, quick="tiny sizes for a smoke test", **smoke)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.producer_child:
        config, producer_id, latency, verify = args.producer_child
        return producer_child(config, producer_id, float(latency), verify=verify)
    from consumers.trainer import _quiet_transformers

    _quiet_transformers()
    torch.set_num_threads(1)  # the trainer's writer is one thread; producers have one each
    began = time.monotonic()
    results, clock = {}, Clock()
    with tempfile.TemporaryDirectory(prefix="streamer-wsync-") as tmp, C.server_url(args) as url:
        for kind in args.models:
            for rank in args.lora:
                name = f"{kind}+lora{rank}" if rank else kind
                results[name] = measure(
                    kind, url=url, workdir=Path(tmp) / name, args=args, clock=clock, lora_rank=rank
                )
    report(results, args)
    print(f"bench took {time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
