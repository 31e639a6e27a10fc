"""Run one `streamer` command in this process and report which heavy modules it imported.

    python tests/role_modules.py OUT.json READY COMMAND [ARGS ...]

READY says when a long-running role has started: ``exit`` (a command that ends by itself),
``http:PORT`` (the exporter serves /metrics), ``file:DIR`` (the archiver has written a
rollout file), ``glob:DIR/PATTERN`` (a file matching it has been written: the tracker's), ``up`` (`up` has started its roles and drawn its progress once; each role is a
placeholder ``sleep`` here, so what is measured is `up` itself). Then this process sends
itself SIGTERM, as a person stopping the role would. OUT.json gets the exit code and, at the
ready point and at the end, whether torch, transformers or a transformers model class was
imported. tests/test_role_imports.py runs it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from waits import wait_until  # tests/ is this script's directory

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60.0  # seconds a role may take to become ready


def heavy() -> dict[str, bool]:
    names = list(sys.modules)
    return {
        "torch": "torch" in sys.modules,
        "transformers": "transformers" in sys.modules,
        "model_class": any(n.startswith("transformers.models.") and ".modeling_" in n for n in names),
    }


def _serves_metrics(port: str) -> bool:
    """Whether the exporter on ``port`` answers /metrics; an OSError while it starts."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.status == 200


def _ready_check(ready: str, ticked: threading.Event):
    kind, _, arg = ready.partition(":")
    if kind == "http":
        return lambda: _serves_metrics(arg)
    if kind == "file":
        return lambda: any(f.stat().st_size > 0 for f in Path(arg).glob("rollouts-*.jsonl.gz"))
    if kind == "glob":
        where = Path(arg)
        return lambda: any(f.stat().st_size > 0 for f in where.parent.glob(where.name))
    if kind == "up":
        return ticked.is_set
    raise SystemExit(f"unknown READY {ready!r}")


def _placeholder_roles(ticked: threading.Event) -> None:
    """`up`'s roles become ``sleep``; the first progress tick marks `up` as started."""
    from streamer.cli import progress, up

    up._role_argv = lambda cmd, cfg, args, *extra: ["sleep", "120"]
    tick = progress.Progress.tick

    def tick_and_tell(self, *a, **kw):
        try:
            return tick(self, *a, **kw)
        finally:
            ticked.set()

    progress.Progress.tick = tick_and_tell


def main(out: str, ready: str, argv: list[str]) -> int:
    report: dict = {}
    ticked = threading.Event()
    if ready == "up":
        _placeholder_roles(ticked)
    if ready != "exit":
        is_ready = _ready_check(ready, ticked)

        def watch() -> None:
            try:
                wait_until(is_ready, timeout=WAIT, what=f"the role to start ({ready})", ignore=(OSError,))
            except AssertionError as e:
                report["error"] = str(e)
            report["at_ready"] = heavy()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, daemon=True).start()
    from streamer import cli

    try:
        report["code"] = cli.main(argv)
    except SystemExit as e:
        report["code"] = e.code
    report["at_end"] = heavy()
    Path(out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
