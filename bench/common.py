"""Shared helpers for the benchmarks: a private server, realistic groups, timing, tables.

Every benchmark compares two or more ways of doing the same work side by side, in one run,
against one server, and reports the median of several repeats (these machines are noisy).
Sides alternate their order from one repeat to the next so a drift in machine load does not
favour whichever runs first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from schemas import Sample, TrajectoryGroup  # noqa: E402
from streamer.config import write_toml  # noqa: E402
from streamer.connection import connect  # noqa: E402
from streamer.keys import Keys  # noqa: E402
from streamer.server import EmbeddedServer  # noqa: E402

WIDE_OPEN = 10**9  # a limit that never binds: admission and backpressure out of the way
VOCAB = 151_936  # Qwen-sized vocabulary: realistic token id magnitudes for every codec
PROMPT_FRACTION = 0.25  # share of each sample's tokens that are prompt (no log-probs)


# ---------------------------------------------------------------- server and keys


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--redis-url", help="use this server instead of a private embedded one")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per side; medians reported")
    ap.add_argument(
        "--no-aof",
        action="store_true",
        help="embedded server without its append-only file (default: AOF everysec, as `streamer up` runs it)",
    )


def parse_args(
    ap: argparse.ArgumentParser, argv: Sequence[str] | None, *, quick: str, **smoke: object
) -> argparse.Namespace:
    """``argv`` parsed by ``ap``, which gains ``--quick`` (its help: ``quick``): the ``smoke``
    values then replace the defaults (the sizes tests/test_bench_smoke.py runs)."""
    ap.add_argument("--quick", action="store_true", help=quick)
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(smoke)
    return args


def add_payload_args(ap: argparse.ArgumentParser, *, mb: float, mb_help: str) -> None:
    """``--sizes`` (tokens per sample, a list) and ``--group-size``: the shape of the groups;
    ``--mb`` (default ``mb``): how much of them a repeat moves."""
    ap.add_argument("--sizes", type=_ints, default="512,4096", help="tokens per sample, comma separated")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group (G)")
    ap.add_argument("--mb", type=float, default=mb, help=mb_help)


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",")]


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """The URL of ``--redis-url``, or of a private valkey-server started for this run."""
    if args.redis_url:
        yield args.redis_url
        return
    extra = ("--appendonly", "no") if getattr(args, "no_aof", False) else ()
    with (
        tempfile.TemporaryDirectory(prefix="streamer-bench-") as tmp,
        EmbeddedServer(Path(tmp) / "valkey", extra_args=extra) as server,
    ):
        yield server.url


def fresh_keys(prefix: str = "bench") -> Keys:
    return Keys(f"{prefix}{uuid.uuid4().hex[:10]}")


def write_run_config(workdir: Path, keys: Keys, url: str, **sections: dict) -> Path:
    """``workdir/{run}.toml``: run ``keys.run`` on the server at ``url`` with its data under
    ``workdir``, and ``sections`` (``trainer={...}``, ...); what a role's --config takes."""
    run = {"name": keys.run, "redis_url": url, "data_dir": str(workdir)}
    return write_toml(workdir / f"{keys.run}.toml", {"run": run, **sections})


def remote_producer(sampler_url: str, *, group_size: int, concurrency: int = 1, **fields: object) -> dict:
    """A [producer] section sampling two tokens per completion from ``sampler_url`` (a fake
    server), ``concurrency`` rows in flight; ``fields`` add to it."""
    return {
        "sampler": "remote",
        "remote_url": sampler_url,
        "group_size": group_size,
        "max_new_tokens": 2,
        "shutdown_grace": 5.0,
        "concurrency": concurrency,
        "remote_concurrency": max(8, concurrency),
        **fields,
    }


def drop_run(client, keys: Keys) -> None:
    """Delete every key of ``keys``' run (and nothing else)."""
    for key in client.scan_iter(match=keys.all_keys_pattern(), count=1000):
        client.delete(key)


def server_version(client) -> str:
    info = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"


def settle(client, timeout: float = 10.0) -> None:
    """Wait until the server has freed deleted keys (valkey frees big keys in a background
    thread), so that work does not land in the next measurement."""
    deadline = time.monotonic() + timeout
    while client.info("memory").get("lazyfree_pending_objects", 0):
        if time.monotonic() > deadline:
            raise SystemExit(f"the server is still freeing deleted keys after {timeout:.0f} s")
        time.sleep(0.01)


def server_cpu(client) -> float:
    """CPU seconds the server process has used (all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Stopwatch:
    """Wall, client CPU and server CPU seconds of the code between start() and stop()."""

    def __init__(self, client):
        self.client = client
        self.wall = self.cpu = self.server = 0.0

    def start(self) -> None:
        settle(self.client)
        self._s0 = server_cpu(self.client)
        self._c0, self._w0 = time.process_time(), time.perf_counter()

    def stop(self) -> Stopwatch:
        self.wall = time.perf_counter() - self._w0
        self.cpu = time.process_time() - self._c0
        self.server = server_cpu(self.client) - self._s0
        return self


class RoundTrips:
    """Round trips a client makes to its server, counted where redis-py sends them: a command,
    a pipeline or a script call (EVALSHA) is one each. Not counted: a new connection's
    handshake (CLIENT SETNAME ...) and health-check PINGs (after 30 s idle), and threads
    whose name starts with one of ``exclude`` (the producer's heartbeat): they happen per
    connection, per idle spell and per 2 s, not per group."""

    def __init__(self, client, *, exclude: tuple[str, ...] = ("heartbeat-",)):
        self.count, self.exclude = 0, exclude
        counter = self
        pool = client.connection_pool

        class Counted(pool.connection_class):
            handshake = False

            def connect_check_health(self, *args, **kwargs):
                return self._quietly(super().connect_check_health, *args, **kwargs)

            def check_health(self):
                return self._quietly(super().check_health)

            def _quietly(self, fn, *args, **kwargs):
                self.handshake, before = True, self.handshake
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.handshake = before

            def send_packed_command(self, command, check_health=True):
                if not self.handshake and not threading.current_thread().name.startswith(counter.exclude):
                    counter.count += 1
                return super().send_packed_command(command, check_health)

        pool.reset()  # every connection from now on is a counted one
        pool.connection_class = Counted


def bench_client(url: str):
    """A checked client with a socket timeout well above any block a benchmark uses."""
    return connect(url, socket_timeout=30.0, name="bench")


# ---------------------------------------------------------------- realistic payloads


def make_groups(n: int, *, tokens: int, group_size: int = 8, seed: int = 0) -> list[TrajectoryGroup]:
    """``n`` groups of ``group_size`` samples of ``tokens`` tokens each, with log-probs.

    A quarter of each sample is prompt; every completion token has a sampler log-prob.
    Token ids span a 152k vocabulary so varint/pickle/json sizes are realistic.
    """
    rng = np.random.default_rng(seed)
    prompt = max(1, int(tokens * PROMPT_FRACTION))
    out = []
    for g in range(n):
        samples = [
            Sample.build(
                prompt_ids=rng.integers(0, VOCAB, prompt),
                completion_ids=rng.integers(0, VOCAB, tokens - prompt),
                logprobs=-rng.exponential(1.0, tokens - prompt).astype(np.float32),
                reward=float(rng.integers(0, 2)),
                finish_reason="stop",
                version=3,
            )
            for _ in range(group_size)
        ]
        out.append(group(g, samples))
    return out


def group(i: int, samples: list[Sample]) -> TrajectoryGroup:
    """A bench's group ``i`` (row ``i``, epoch 0) of ``samples``, tagged with their oldest version."""
    version = min(s.version for s in samples)
    return TrajectoryGroup(
        group_id=f"g{i}",
        row=i,
        epoch=0,
        producer_id="bench",
        samples=samples,
        policy_version=version,
        created_at=time.time(),
    )


def random_group(i: int, rng, *, prompt: int, completions: Sequence[int], vocab: int) -> TrajectoryGroup:
    """Group ``i`` of random tokens (ids from 2 up: 0 pads, 1 ends), drawn from ``rng`` (a
    ``random.Random``): a prompt of ``prompt`` tokens and a completion of each length in
    ``completions``, sampler log-probs -5 to -7, rewards 0, 1, 0, ... (no zero variance)."""
    prompt_ids = [rng.randrange(2, vocab) for _ in range(prompt)]
    samples = []
    for j, length in enumerate(completions):
        ids = [rng.randrange(2, vocab) for _ in range(length)]
        samples.append(
            Sample.build(
                prompt_ids=prompt_ids,
                completion_ids=ids,
                logprobs=[-rng.uniform(5.0, 7.0) for _ in ids],
                reward=float(j % 2),
                finish_reason="stop",
                version=0,
            )
        )
    return group(i, samples)


def sampled_group(i: int, prompt: list[int], completions) -> TrajectoryGroup:
    """Group ``i`` of what a sampler returned for ``prompt`` (a list of ``Completion``), as
    sampled by version 0; rewards alternate 0, 1, 0, ... so no group has zero variance."""
    samples = [
        Sample.build(
            prompt_ids=prompt,
            completion_ids=c.token_ids,
            logprobs=c.logprobs,
            reward=float(j % 2),
            finish_reason=c.finish_reason,
            version=0,
        )
        for j, c in enumerate(completions)
    ]
    return group(i, samples)


def as_plain_dict(group: TrajectoryGroup) -> dict:
    """The group as plain Python containers (token ids and log-probs as lists), the shape
    a pickle- or JSON-based transport carries."""
    return {
        "group_id": group.group_id,
        "row": group.row,
        "epoch": group.epoch,
        "producer_id": group.producer_id,
        "policy_version": group.policy_version,
        "created_at": group.created_at,
        "published_at": group.published_at,
        "samples": [
            {
                "input_ids": s.token_ids().tolist(),
                "logprobs": s.sampler_logprobs().tolist(),
                "prompt_len": s.prompt_len,
                "reward": s.reward,
                "finish_reason": s.finish_reason,
                "version": s.version,
            }
            for s in group.samples
        ],
    }


def tensor_ready(group: TrajectoryGroup) -> tuple[np.ndarray, np.ndarray]:
    """What a trainer collates from a decoded group: all token ids, all sampler log-probs."""
    ids = np.concatenate([s.token_ids() for s in group.samples])  # (G*T,) int32
    lps = np.concatenate([s.sampler_logprobs() for s in group.samples])  # (G*(T-P),) float32
    return ids, lps


def plain_tensor_ready(group: dict) -> tuple[np.ndarray, np.ndarray]:
    """The same arrays from the plain-dict form (lists must be converted element by element)."""
    ids = np.concatenate([np.asarray(s["input_ids"], np.int32) for s in group["samples"]])
    lps = np.concatenate([np.asarray(s["logprobs"], np.float32) for s in group["samples"]])
    return ids, lps


# ---------------------------------------------------------------- models and trainer steps


def qwen2(*, vocab: int, hidden: int, layers: int, seq: int, heads: int, kv_heads=0, tie=False, seed=0):
    """An untrained Qwen2 built from a config (MLP 3 x ``hidden``, token 0 pads, 1 ends),
    deterministic for ``seed``; ``kv_heads`` 0: as many as ``heads``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=seq,
        tie_word_embeddings=tie,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def random_batch(rows: int, seq: int, *, vocab: int, prompt: int, logp: float = 0.0):
    """The same ``Batch`` every call: ``rows`` rows of ``seq`` random tokens, the first
    ``prompt`` of each not trained, sampler log-probs between ``logp`` - 1 and ``logp``."""
    import torch

    from consumers.batch import Batch

    g = torch.Generator().manual_seed(1)
    return Batch(
        input_ids=torch.randint(0, vocab, (rows, seq), generator=g),
        attention_mask=torch.ones(rows, seq, dtype=torch.int64),
        weights=torch.cat([torch.zeros(rows, prompt), torch.ones(rows, seq - 1 - prompt)], 1),
        sampler_logp=logp - torch.rand(rows, seq - 1, generator=g),
        advantages=torch.randn(rows, generator=g),
    )


def sync(device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def train_steps(learner, batch, steps: int) -> tuple[float, dict[str, float]]:
    """Seconds ``steps`` calls of ``learner.train_step(batch)`` took after one warm-up call
    (on CUDA: synchronised, the peak memory counted from there), and the last call's metrics."""
    import torch

    learner.train_step(batch)
    sync(learner.device)
    if learner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(learner.device)
    began = time.perf_counter()
    for _ in range(steps):
        metrics = learner.train_step(batch)
    sync(learner.device)
    return time.perf_counter() - began, metrics


# ---------------------------------------------------------------- timing and reporting


def alternate(sides: Sequence[str], repeat: int) -> list[str]:
    """Run order for one repeat: forwards on even repeats, backwards on odd ones."""
    return list(sides) if repeat % 2 == 0 else list(reversed(sides))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A small right-aligned text table; floats with 3 significant figures or more."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def print_ratios(
    ratios: dict[str, float], *, goals: dict[str, str] | None = None, counts: dict[str, float] | None = None
) -> None:
    """The final line every benchmark prints: ``ratios: name=1.23x (goal >= 0.90: met) ...``,
    then ``counts`` as plain numbers (``name=2``)."""
    parts = []
    for name, value in {**ratios, **(counts or {})}.items():
        goal = (goals or {}).get(name)
        text = f"{value:.2f}x" if name in ratios else f"{value:g}"
        parts.append(f"{name}={text}" + (f" ({goal})" if goal else ""))
    print("ratios: " + "  ".join(parts), flush=True)


def verdict(value: float, *, at_least: float) -> str:
    return f"goal >= {at_least:g}: {'met' if value >= at_least else 'NOT met'}"


def mb(n_bytes: float) -> float:
    return n_bytes / 1e6


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c == 0 or abs(c) >= 100:
            return f"{c:,.0f}"
        return f"{c:.3g}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def spawn_role(
    role: str,
    config: Path,
    *extra: str,
    log: Path | None = None,
    threads: int = 0,
    log_level: str = "WARNING",
) -> subprocess.Popen:
    """``python -m streamer {role} --config {config} {extra}`` from this checkout, in the
    config's directory; output appended to ``log`` (None: inherited); ``threads`` > 0 sets
    OMP_NUM_THREADS (oversubscribed torch threads slow every process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "streamer", "--log-level", log_level, role, "--config", str(config), *extra]
    if log is None:
        return subprocess.Popen(cmd, cwd=config.parent, env=env)
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, cwd=config.parent, env=env, stdout=fh, stderr=subprocess.STDOUT)


def run_up(cfg, workdir: Path, *extra: str, timeout: float, during: Callable[[], None] | None = None) -> dict:
    """`streamer up --fresh` of ``cfg`` (a RunConfig) with its data in ``workdir`` and
    ``extra`` arguments, its output in ``workdir/up.log``; ``during()`` is called once it has
    started. Past ``timeout`` seconds it is stopped as by Ctrl-C (its curve still recorded).
    Returns the curve it recorded (curve.json) with ``wall``: the seconds it ran."""
    config = write_toml(workdir / "run.toml", msgspec.to_builtins(cfg))
    argv = [sys.executable, "-m", "streamer", "up", "--config", str(config), "--fresh", "--no-progress"]
    argv += ["--data-dir", str(workdir), *extra]
    began = time.monotonic()
    with open(workdir / "up.log", "w+") as log:
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if during is not None:
            during()
        try:
            up.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            up.terminate()
            up.wait(timeout=120)
        if up.returncode not in (0, 130):
            log.seek(0)
            sys.exit(f"streamer up exited {up.returncode}:\n{log.read()[-4000:]}")
    curve = json.loads((workdir / cfg.run.name / "curve.json").read_text())
    return {**curve, "wall": time.monotonic() - began}


def stop_processes(procs, grace: float = 20.0) -> None:
    """SIGTERM every process still running, then wait; kill those not gone within ``grace``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------- CPU of child processes, by role

TICK = os.sysconf("SC_CLK_TCK")
ROLE = re.compile(r" -m streamer(?:\.cli\.| (?:--log-level \S+ )?)(\w+)")  # streamer.cli.forkserver too
ROLE_EVERY = 0.25  # seconds between two readings of every descendant's CPU from /proc


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's children that have been waited for,
    every descendant of theirs included."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def role_tree(pid: int) -> dict[int, tuple[str, float]]:
    """pid's descendants (and itself): pid -> (role, CPU seconds so far)."""
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            f = stat.rpartition(")")[2].split()
            stats[int(d.name)] = (int(f[1]), cmd, (int(f[11]) + int(f[12])) / TICK)
    out, frontier = {}, {pid}
    while frontier:
        for p in frontier:
            if p in stats:
                _, cmd, cpu = stats[p]
                m = ROLE.search(cmd)
                role = m.group(1) if m else ("valkey" if "valkey" in cmd else Path(cmd.split(" ")[0]).name)
                role = "" if not cmd.strip() else role
                out[p] = (role, cpu)
        frontier = {p for p, (pp, _, _) in stats.items() if pp in frontier and p not in out}
    return out


def run_by_role(argv: list[str], env: dict[str, str]) -> tuple[int, str, float, dict[str, float]]:
    """Run ``argv`` to its end, its stdout and stderr captured together. Returns its exit
    code, its output, the CPU seconds of it and every descendant (exact: counted once it is
    waited for) and those seconds by process role (each process's last reading from /proc
    before it exits, so a role misses at most the last ``ROLE_EVERY`` s of each process)."""
    before = children_cpu()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, tuple[str, float]] = {}
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        for pid, (role, cpu) in role_tree(proc.pid).items():
            old_role, old_cpu = seen.get(pid, ("", 0.0))
            seen[pid] = (role or old_role, max(cpu, old_cpu))  # an exited child has no cmdline
        time.sleep(ROLE_EVERY)
    reader.join(10)
    cpu = children_cpu() - before
    roles: dict[str, float] = {}
    for role, seconds in seen.values():
        roles[role] = roles.get(role, 0.0) + seconds
    return proc.returncode, "".join(out), cpu, roles


def print_roles(roles: dict[str, float], versions: int) -> None:
    """``roles`` (role -> CPU s) as a table, the most first: CPU s, share, CPU s per version."""
    total = sum(roles.values()) or 1.0
    print_table(
        ["role", "CPU s", "share", "CPU s / version"],
        [[r, s, f"{s / total:.0%}", s / versions] for r, s in sorted(roles.items(), key=lambda kv: -kv[1])],
    )
