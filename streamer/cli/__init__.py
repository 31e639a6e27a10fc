"""`streamer` command line: one role per process, or `up` for all of them on one machine.

Exit codes: 0 done, 1 failed at run time, 2 bad config or arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys

import redis

from streamer import demo
from streamer.config import URL_ENV, RunConfig, load_config, replace
from streamer.connection import connect
from streamer.errors import ConfigError, StreamerError
from streamer.keys import Keys
from streamer.values import wrong_type

log = logging.getLogger("streamer")

# subcommand -> "module:function(cfg, args) -> int"
ROLES = {
    "up": "streamer.cli.up:main",
    "train": "consumers.trainer:main",
    "produce": "producers.producer:main",
    "eval": "producers.evaluator:main",
    "metrics": "consumers.exporter:main",
    "status": "streamer.cli.status:main",
    "archive": "consumers.archive:main",
    "track": "consumers.tracker:main",
    "samples": "streamer.cli.samples:samples_main",
    "dead": "streamer.cli.samples:dead_main",
    "rows": "streamer.cli.rows:main",
    "plot": "streamer.cli.plot:main",
    "smoke": "streamer.cli.smoke:main",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamer", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def role(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--config", help="TOML run config (default: the built-in demo)")
        sp.add_argument(
            "--task", help="a built-in task instead of a config: retry, tools, reasoning_gym:NAME"
        )
        sp.add_argument(
            "--redis-url", help=f"override run.redis_url (${URL_ENV} too; keeps a password off argv)"
        )
        sp.add_argument("--run", help="override run.name")
        sp.add_argument("--data-dir", help="override run.data_dir")
        return sp

    up = role("up", "run everything on one machine (embedded server unless --redis-url)")
    up.add_argument("--steps", type=int, help="trainer steps to run (default: the demo's)")
    up.add_argument(
        "--producers",
        type=_positive,
        help="producer processes (default: one per core beside the trainer's, 1 to 4)",
    )
    up.add_argument("--fresh", action="store_true", help="discard the previous run's state")
    up.add_argument(
        "--reset-rows",
        action="store_true",
        help="bring back the rows set aside as solved or unsolvable (keeps checkpoints)",
    )
    up.add_argument("--no-progress", action="store_true", help="no live progress view")
    up.add_argument(
        "--until-eval", type=float, metavar="ACC", help="stop once eval accuracy reaches ACC (early stop)"
    )
    up.add_argument(
        "--engine",
        choices=("vllm",),
        help="sample through an inference server that up starts and stops (its own virtualenv)",
    )

    tr = role("train", "the trainer consumer")
    tr.add_argument("--steps", type=int, help="override trainer.steps")
    tr.add_argument("--nproc", type=int, default=1, help="data-parallel ranks on this machine (via torchrun)")
    tr.add_argument(
        "--from-initial-weights",
        action="store_true",
        help="train from the initial weights even though the server records a checkpoint of the run",
    )
    pr = role("produce", "a rollout producer")
    pr.add_argument("--id", help="producer id (default: host-pid)")
    pr.add_argument("--max-groups", type=int, help="override producer.max_groups")
    role("eval", "the evaluator")
    me = role("metrics", "the Prometheus exporter")
    me.add_argument("--port", type=int, help="override metrics.port")
    me.add_argument("--host", help="override metrics.host")
    st = role("status", "streams, lag, versions, producers, dead letters of a run")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    role("archive", "the rollout archiver (groups as text under the run's data dir)")
    role("track", "experiment tracking: the run's metrics into TensorBoard or W&B (tracking.backend)")
    sa = role("samples", "recent rollouts of a run, as text, from its archive")
    sa.add_argument("--last", type=int, default=5, help="groups to print (default 5)")
    sa.add_argument("--min-reward", type=float, help="only completions with reward >= this")
    sa.add_argument("--follow", action="store_true", help="keep printing new groups")
    de = role("dead", "dead letters of a run, with their reasons")
    de.add_argument("--last", type=int, default=20, help="newest dead letters to list (default 20)")
    de.add_argument("--replay", metavar="ID", help="re-publish this dead letter to its stream")
    ro = role("rows", "dataset rows active / set aside; `rows reset` brings the set-aside ones back")
    ro.add_argument("action", nargs="?", choices=("show", "reset"), default="show")
    pl = role("plot", "a PNG of the run: reward/accuracy per version, loss/staleness per step")
    pl.add_argument("--out", help="PNG path (default {data_dir}/{run}/run.png)")
    role("smoke", "a round trip of every event type through an embedded server")
    cd = sub.add_parser("config-doc", help="print the config reference (Markdown)")
    cd.add_argument("--write", metavar="FILE", help="update the reference between FILE's markers")
    cd.add_argument("--check", metavar="FILE", help="exit 1 when FILE's reference is stale")
    return p


def _positive(text: str) -> int:
    """An argument that counts something there must be at least one of."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1 (nothing would produce rollouts)")
    return value


def resolve_config(args: argparse.Namespace) -> RunConfig:
    task = getattr(args, "task", None)
    if task and getattr(args, "config", None):
        raise ConfigError("--task and --config exclude each other")
    if task:
        from streamer.rollout import tasks

        cfg = tasks.config(task)
    else:
        path = getattr(args, "config", None)
        cfg = demo.config() if path is None else load_config(path)
    url = args.redis_url if args.redis_url is not None else (os.environ.get(URL_ENV) or None)
    run = {
        k: v
        for k, v in (("redis_url", url), ("name", args.run), ("data_dir", args.data_dir))
        if v is not None
    }
    try:
        if run:
            cfg = replace(cfg, run=run)
        if getattr(args, "steps", None) is not None:
            cfg = replace(cfg, trainer={"steps": args.steps})
        if getattr(args, "max_groups", None) is not None:
            cfg = replace(cfg, producer={"max_groups": args.max_groups})
        metrics = {k: getattr(args, k) for k in ("port", "host") if getattr(args, k, None) is not None}
        if metrics:
            cfg = replace(cfg, metrics=metrics)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"command line: {e}") from None
    return cfg


def _refusal(cfg: RunConfig, e: redis.exceptions.ResponseError) -> str:
    """What the server refused; a key of the run that holds another type is named (the
    server's WRONGTYPE does not say which)."""
    if cfg.run.redis_url:
        try:
            client = connect(cfg.run.redis_url, socket_timeout=cfg.bus.socket_timeout, check=False)
            if named := wrong_type(client, Keys(cfg.run.name).types(), e):
                return str(named)
        except (StreamerError, redis.exceptions.RedisError):
            pass
    return f"the server refused a command on this run's keys: {e}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.cmd == "config-doc":
        from streamer.cli.configdoc import render, sync

        if args.check:
            fresh = sync(args.check, check=True)
            print(f"{args.check}: config reference is {'current' if fresh else 'stale'}")
            return 0 if fresh else 1
        if args.write:
            sync(args.write, check=False)
        else:
            print(render())
        return 0
    try:
        cfg = resolve_config(args)
        module, _, func = ROLES[args.cmd].partition(":")
        entry = getattr(importlib.import_module(module), func)
        if not gc.isenabled():  # imported with the collector off (streamer.__main__)
            gc.freeze()
            gc.enable()
        return int(entry(cfg, args) or 0)
    except ConfigError as e:
        print(f"streamer {args.cmd}: config error: {e}", file=sys.stderr)
        return 2
    except StreamerError as e:
        print(f"streamer {args.cmd}: {e}", file=sys.stderr)
        return 1
    except redis.exceptions.ResponseError as e:  # e.g. WRONGTYPE: a key of the run was overwritten
        print(f"streamer {args.cmd}: {_refusal(cfg, e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
