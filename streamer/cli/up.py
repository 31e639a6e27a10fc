"""`streamer up`: the whole system on one machine, each role its own OS process.

Starts the embedded Valkey server (unless ``--redis-url``), then the metrics exporter,
the trainer, the evaluator and N producers, all through the same entry points as
``streamer train|produce|eval|metrics``, each forked from one process that imported the
roles' code once, torch and transformers included (:mod:`streamer.cli.forkserver`). It
prints a live progress view, and when the trainer has finished its steps (or the producers
find every row set aside: nothing left to teach) it stops the rest in order and prints a
summary.
Running it again in the same data directory resumes the run; ``--fresh`` starts over
(deleting only what Streamer created and marked, see :mod:`streamer.rundir`).

Signals (see :mod:`streamer.lifecycle`): every child runs in a session of its own, so a
terminal's Ctrl-C or hangup reaches `up` only. SIGINT, SIGTERM and SIGHUP stop the run in
order — producers, evaluator, trainer (final checkpoint), exporter, and the server last —
and `up` exits 130; a second signal during that stop kills the roles at once. Children
get SIGTERM from the kernel if `up` dies without stopping them. A closed stdout (the
terminal went away) turns progress output off instead of failing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from streamer import rows
from streamer.cli import plot
from streamer.cli.forkserver import ForkServer
from streamer.cli.progress import Progress
from streamer.config import URL_ENV, RunConfig, replace
from streamer.connection import connect, redact
from streamer.errors import ConfigError
from streamer.keys import Keys
from streamer.lifecycle import Child, QuietStdout, restore_signals
from streamer.rundir import (
    ENGINE_CONFIG,
    ENGINE_MODEL,
    RUN_ENTRIES,
    RUN_MARKER,
    SERVER_MARKER,
    check_free,
    mark,
    mark_run,
    remove_marked,
    server_lock,
    trainer_lock,
)
from streamer.server import EmbeddedServer, free_port
from streamer.values import check_types, wrong_type

log = logging.getLogger(__name__)

MODEL_ROLES = ("train", "eval", "produce")
FINAL_EVAL_WAIT = 60.0  # how long to wait for the evaluation of the final version
# how often `up --until-eval` reads the evaluator's scores: each second of delay is ~10 more
# versions of the demo trained (and their CPU spent) past the one that reached the target
UNTIL_EVAL_TICK = 0.1


@dataclass
class Stack:
    """The children of one `up`, in start order; stopped in the order that loses nothing."""

    children: dict[str, Child] = field(default_factory=dict)
    server: EmbeddedServer | None = None

    STOP_ORDER = ("produce", "eval", "engine", "train", "archive", "track", "metrics")

    def stop_children(self, *, with_producers: tuple[str, ...] = ()) -> None:
        """Stop every child, kind by kind in :attr:`STOP_ORDER`; ``with_producers``: kinds
        stopped together with the producers instead (a run that reached its goal trains no
        further while they stop)."""
        first = ("produce", *with_producers)
        for kinds in [first, *[k for k in self.STOP_ORDER if k not in first]]:
            group = [c for n, c in self.children.items() if n.startswith(kinds)]
            threads = [threading.Thread(target=c.stop) for c in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def stop_server(self) -> None:
        if self.server:
            self.server.stop()

    def failed(self) -> Child | None:
        return next(
            (c for c in self.children.values() if c.exited() not in (None, 0) and not c.stopping), None
        )


def _role_argv(cmd: str, cfg: RunConfig, args, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "streamer", "--log-level", args.log_level, cmd]
    if getattr(args, "engine_config", None):  # up's own config, with the engine's settings
        argv += ["--config", args.engine_config]
    elif args.config:
        argv += ["--config", args.config]
    if getattr(args, "task", None) and not getattr(args, "engine_config", None):
        argv += ["--task", args.task]
    # the server URL (a password, perhaps) travels in the environment (URL_ENV), never in
    # argv: /proc/PID/cmdline is readable by every local user, /proc/PID/environ only by us
    argv += ["--run", cfg.run.name, "--data-dir", cfg.run.data_dir]
    return argv + list(extra)


def _metrics_port(cfg: RunConfig) -> int:
    import socket

    with socket.socket() as s:
        try:
            s.bind((cfg.metrics.host, cfg.metrics.port))
            return cfg.metrics.port
        except OSError:
            port = free_port()
            log.info("port %d is taken; serving /metrics on %d", cfg.metrics.port, port)
            return port


def _fresh(cfg: RunConfig, embedded: bool) -> None:
    """Delete the run's state: only directories Streamer marked, only what it wrote in them."""
    remove_marked(cfg.run_dir, RUN_MARKER, RUN_ENTRIES)
    if embedded:
        remove_marked(Path(cfg.run.data_dir) / "valkey", SERVER_MARKER)
    else:
        client = connect(cfg.run.redis_url)
        for key in client.scan_iter(match=Keys(cfg.run.name).all_keys_pattern(), count=1000):
            client.delete(key)


def main(cfg: RunConfig, args) -> int:
    started = time.monotonic()
    stack, stop_requested = Stack(), threading.Event()
    old = _take_stop_signals(stack, stop_requested)  # first: a signal at any point stops `up` in order
    try:
        return _main(cfg, args, started, stack, stop_requested)
    finally:
        restore_signals(old)


def _take_stop_signals(stack: Stack, stop_requested: threading.Event) -> dict:
    """SIGINT, SIGTERM and SIGHUP set ``stop_requested``, which every step of start-up and
    the supervisor check; a second SIGINT/SIGTERM kills the roles (a hangup never escalates).
    Returns the handlers they replace, for :func:`restore_signals`."""

    def on_signal(signum, frame):
        if stop_requested.is_set() and signum != signal.SIGHUP:
            for child in stack.children.values():
                child.kill()
        stop_requested.set()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def _main(cfg: RunConfig, args, started: float, stack: Stack, stop_requested: threading.Event) -> int:
    from producers import eval_sets

    eval_sets.prepare(cfg)  # a bad eval set is a one-line config error before anything starts
    embedded = not cfg.run.redis_url
    data_dir = Path(cfg.run.data_dir).resolve()
    cfg = replace(cfg, run={"data_dir": str(data_dir)})
    # one `up` per data dir with an embedded server, one trainer per run: fail now, one line
    lock = server_lock(data_dir).acquire() if embedded else None
    try:
        check_free(trainer_lock(cfg.run_dir))
        if args.fresh:
            _fresh(cfg, embedded)
        mark_run(cfg.run_dir)
        engine = None
        if getattr(args, "engine", None):
            cfg, engine = _engine(cfg, args)
        return _run(cfg, args, started, embedded, stack, stop_requested, engine)
    finally:
        if lock is not None:
            lock.release()


def _engine(cfg: RunConfig, args) -> tuple[RunConfig, Child]:
    """The inference engine `up` runs for the producers (``--engine vllm``): its child, and
    the config every role reads (written into the run directory, passed as ``--config``)."""
    import msgspec

    from streamer import demo, vllm_server
    from streamer.config import write_toml

    if cfg.model.name_or_path == demo.DEMO:  # the demo model in a shape vLLM serves
        model_dir = demo.save_for_engine(cfg.run_dir / ENGINE_MODEL, seed=cfg.run.seed).resolve()
    else:
        model_dir = Path(cfg.model.name_or_path)
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"--engine {args.engine}: model.name_or_path must be a local model directory")
    port = free_port()
    cfg = replace(
        cfg,
        model={"name_or_path": str(model_dir), "tokenizer": cfg.model.tokenizer or str(model_dir)},
        producer={
            "sampler": "remote",
            "engine": args.engine,
            "remote_url": f"http://127.0.0.1:{port}",
            "remote_model": str(model_dir),
        },
    )
    server = vllm_server.VllmServer(
        model_dir,
        log_path=cfg.log_dir / "engine.log",
        port=port,
        dtype=cfg.model.dtype,
        max_model_len=_max_len(model_dir),
        lora_rank=cfg.model.lora.rank,
    )
    args.engine_config = str(write_toml(cfg.run_dir / ENGINE_CONFIG, msgspec.to_builtins(cfg)))
    return cfg, server.child


def _max_len(model_dir: Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return min(int(config.get("max_position_embeddings") or 4096), 4096)


def _run(
    cfg: RunConfig,
    args,
    started: float,
    embedded: bool,
    stack: Stack,
    stop_requested: threading.Event,
    engine: Child | None = None,
) -> int:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = QuietStdout(sys.stdout), QuietStdout(sys.stderr)
    try:
        if stop_requested.is_set():
            print("streamer up: interrupted before anything started", flush=True)
            return 130
        if embedded:
            valkey_dir = mark(Path(cfg.run.data_dir) / "valkey", SERVER_MARKER)
            stack.server = EmbeddedServer(valkey_dir, die_with_parent=True).start()
            cfg = replace(cfg, run={"redis_url": stack.server.url})
        try:
            client = connect(cfg.run.redis_url)  # one clear line now if the server is unusable
            keys = Keys(cfg.run.name)
            check_types(client, keys.types())  # a key of another type: one line, before any role
            if stop_requested.is_set():
                what = "stopping (server) ..." if embedded else "nothing was started"
                print(f"streamer up: interrupted; {what}", flush=True)
                return 130
            if getattr(args, "reset_rows", False):
                n = rows.reset(client, Keys(cfg.run.name))
                print(
                    f"streamer up: every row record forgotten; {n} rows set aside are active again",
                    flush=True,
                )
            if engine is not None:  # first: it takes longest to start; producers wait for it
                stack.children[engine.name] = engine
                engine.start(dict(os.environ))
            try:
                return _start_and_supervise(cfg, args, started, stack, stop_requested)
            except redis.exceptions.ResponseError as e:  # up's own reads: name a key of another type
                raise wrong_type(client, keys.types(), e) or e from None
        finally:
            stack.stop_server()  # last: every role that needed it has stopped
    finally:
        sys.stdout, sys.stderr = streams


def cores() -> int:
    """The cores this process may run on (a container's or a taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_producers(n_cores: int) -> int:
    """Producers `up` starts unless told: one per core beside the trainer's, 1 to 4. More
    busy processes than cores only take turns on them: a model's sampling and training each
    cost more CPU (every switch evicts the other's weights from the core's caches) and finish
    no sooner."""
    return max(1, min(4, n_cores - 1))


def _start_and_supervise(cfg: RunConfig, args, started: float, stack: Stack, stop_requested) -> int:
    port = _metrics_port(cfg)
    steps = cfg.trainer.steps
    env = {**os.environ, "PYTHONUNBUFFERED": "1", URL_ENV: cfg.run.redis_url}
    n_cores = cores()
    producers = args.producers or default_producers(n_cores)
    # N busy processes share this machine's cores: oversubscribed torch threads slow all.
    compute = producers + 2  # producers, trainer, evaluator
    env.setdefault("OMP_NUM_THREADS", str(max(1, n_cores // compute)))
    logs = cfg.log_dir
    specs = [("metrics", _role_argv("metrics", cfg, args, "--port", str(port)))]
    specs.append(
        ("train", _role_argv("train", cfg, args, *(["--steps", str(args.steps)] if args.steps else [])))
    )
    specs.append(("eval", _role_argv("eval", cfg, args)))
    if cfg.archive.enabled:
        specs.append(("archive", _role_argv("archive", cfg, args)))
    if cfg.tracking.backend:
        specs.append(("track", _role_argv("track", cfg, args)))
    specs += [(f"produce-{i}", _role_argv("produce", cfg, args, "--id", f"p{i}")) for i in range(producers)]
    progress = Progress(cfg, target_steps=args.steps or steps, live=not args.no_progress, started=started)
    progress.update()  # a resumed run: the steps trained before this `up`
    first_step, code, summary = progress.train_step, 0, ""
    # forked from one process that imported the roles' code once (streamer.cli.forkserver):
    # the others first, then, once it has imported torch and transformers, the model roles
    ours = [sys.executable, "-m", "streamer"]
    specs.sort(key=lambda spec: spec[0].split("-")[0] in MODEL_ROLES)  # stable: the others first
    forked = [(n, a) for n, a in specs if a[:3] == ours]
    forks = None
    if forked:
        room = max(len("\0".join(a)) + 1 for _, a in forked)
        forks = ForkServer.start(
            env, logs / "forkserver.log", cfg.model.name_or_path, stop_requested, room, models=MODEL_ROLES
        )
    try:
        try:
            for name, argv in specs:
                if stop_requested.is_set():
                    break
                launcher = forks if (name, argv) in forked else None
                stack.children[name] = Child(name, argv, logs / f"{name}.log", forks=launcher)
                stack.children[name].start(env)
        finally:
            if forks is not None:
                forks.close()
        print(
            f"streamer up: run {cfg.run.name!r} on {redact(cfg.run.redis_url)}; "
            f"{producers} producer{'s' if producers > 1 else ''}; /metrics on http://{cfg.metrics.host}:{port}/metrics; "
            f"logs in {logs}",
            flush=True,
        )
        code = _supervise(stack, progress, stop_requested, until_eval=args.until_eval)
        if code == 0 and not stop_requested.is_set() and not progress.reached_eval(args.until_eval):
            final = progress.version() or 0  # the evaluator scores every eval_every-th version
            final -= final % cfg.eval.eval_every
            progress.wait_for_eval(final, FINAL_EVAL_WAIT, stop_requested)
    finally:
        engine = "engine, " if "engine" in stack.children else ""
        # the goal reached: no version trained past it while the producers stop
        goal = progress.reached_eval(args.until_eval)
        stopping = (
            f"producers and trainer, evaluator, {engine}"
            if goal
            else f"producers, evaluator, {engine}trainer, "
        )
        stopping += ("archiver, " if cfg.archive.enabled else "") + (
            "tracker, " if cfg.tracking.backend else ""
        )
        print(f"\nstreamer up: stopping ({stopping}exporter, server) ...", flush=True)
        stack.stop_children(with_producers=("train",) if goal else ())
        elapsed = time.monotonic() - started
        summary = progress.summary(elapsed, cfg.weights_dir)
        progress.record(cfg.run_dir / "curve.json", elapsed)
        title = f"run {cfg.run.name}: {progress.train_step} steps, {progress.groups} groups"
        if picture := plot.save_quietly(progress.history, cfg.run_dir / "run.png", title=title):
            summary += f"\n  picture            {picture}"
    failed = stack.failed()
    if failed is not None:
        code = 1
        print(
            f"\nstreamer up: {failed.name} exited with code {failed.exited()}; last lines of "
            f"{failed.log_path}:\n{failed.tail()}",
            file=sys.stderr,
        )
    print(summary)
    if stop_requested.is_set() and code == 0:
        return 130
    if code == 0 and progress.ended and progress.train_step == first_step:  # the producers finished first
        print(f"streamer up: no step was trained: {progress.ended}. {progress.way_on()}", file=sys.stderr)
        return 1
    return code


def _supervise(stack: Stack, progress: Progress, stop: threading.Event, *, until_eval: float | None) -> int:
    """Until the trainer is done (0), a role fails (1) or eval accuracy reaches ``until_eval``
    (0). When every producer has finished (the data is exhausted, nothing is left to teach,
    ``max_groups``), the trainer is told to train every group that arrived and stop (0);
    ``progress.ended`` then says why."""
    trainer = stack.children.get("train")  # None when a signal came before it started
    producers = [c for name, c in stack.children.items() if name.startswith("produce")]
    while not stop.is_set():
        if stack.failed() is not None:
            return 1
        if trainer is not None and trainer.exited() == 0:
            return 0
        progress.tick()
        if progress.reached_eval(until_eval):
            print(
                f"streamer up: eval accuracy {progress.best_eval:.2f} >= {until_eval:g}: stopping", flush=True
            )
            return 0
        done = all(c.exited() == 0 for c in producers) if producers else progress.nothing_to_teach
        if done and not progress.ended:
            progress.ended = progress.why_producers_stopped()
            if trainer is None or trainer.exited() is not None:
                print(f"\nstreamer up: {progress.ended}; stopping", flush=True)
                return 0
            print(f"\nstreamer up: {progress.ended}; the trainer trains what arrived, then stops", flush=True)
            trainer.signal(signal.SIGUSR1)
        stop.wait(1.0 if until_eval is None else UNTIL_EVAL_TICK)
    return 0
