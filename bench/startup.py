"""Start-up CPU of the roles that run no model: the archiver, the exporter, `status`,
`samples`, `plot` and `up` itself, side by side with another source tree's.

Each role is started for real (`python -m streamer ROLE`) against a private server and a
run with a policy version, a rollout group and metrics on it, and is charged the CPU
seconds (user + system) of its own process:

    archive   from exec until its first rollout file is written (the group decoded)
    metrics   from exec until GET /metrics answers 200
    status, samples, plot   the whole command, to its exit
    up        from exec until it has started its roles and says so; the roles themselves
              are placeholders (``sleep``) here, so this is `up`'s own cost, not theirs

For scale, ``python -c "import torch"`` is measured the same way. With ``--baseline DIR``
every role is also started from the source tree in DIR (e.g. ``git archive COMMIT | tar -x
-C DIR``), alternating with this one, and the ratios are this tree's CPU over DIR's.

    python bench/startup.py                               # 3 repeats
    python bench/startup.py --baseline /tmp/before        # side by side with another tree
    python bench/startup.py --quick                       # one repeat (smoke test)
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from schemas import MetricsEvent, WeightSync, encode
from streamer.bus import FIELD
from streamer.keys import Keys
from streamer.server import free_port

ROLES = ("archive", "samples", "status", "plot", "metrics", "up")
WAIT = 120.0  # seconds a role may take to start before the bench gives up loudly
# `up` with each role replaced by a placeholder: what is measured is `up` itself
UP = (
    "import sys; from streamer import cli; from streamer.cli import up; "
    "up._role_argv = lambda cmd, cfg, args, *extra: ['sleep', '300']; "
    "sys.exit(cli.main(sys.argv[1:]))"
)


def own_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, its children not counted."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def seed(client, keys: Keys) -> None:
    """What every command reads: a rollout group, a policy version, train metrics."""
    (group,) = C.make_groups(1, tokens=16, group_size=4)
    sync = WeightSync(version=0, step=0, uri="file:///nonexistent/v00000000", sha256="0" * 64)
    client.xadd(keys.traj, {FIELD: encode(group)})
    client.xadd(keys.policy, {FIELD: encode(sync)})
    for step in (1, 2):
        event = MetricsEvent(axis="train", step=step, values={"loss": 1.0 / step}, source="trainer")
        client.xadd(keys.metrics, {FIELD: encode(event)})


class Starter:
    """Starts commands from one source tree against one run, charging each its own CPU."""

    def __init__(self, tree: Path, url: str, keys: Keys, data: Path):
        self.tree, self.data = tree, data
        self.common = ["--run", keys.run, "--redis-url", url, "--data-dir", str(data)]
        self.env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}

    def _popen(self, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, *argv], cwd=self.data, env=self.env, stdin=subprocess.DEVNULL, **kw
        )

    def to_exit(self, *argv: str) -> float:
        """CPU of a command that ends by itself."""
        proc = self._popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        return usage.ru_utime + usage.ru_stime

    def until(self, argv: list[str], ready, what: str, *, line: str | None = None) -> float:
        """CPU of a long-running command until ``ready()`` (or it prints ``line``), then SIGTERM."""
        proc = self._popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline, out = time.monotonic() + WAIT, b""
        try:
            while not (line.encode() in out if line else ready()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    out += proc.stdout.read() if proc.poll() is not None else b""
                    raise SystemExit(f"{what} did not start: {out.decode(errors='replace')[-2000:]}")
                if select.select([proc.stdout], [], [], 0.02)[0]:
                    out += os.read(proc.stdout.fileno(), 1 << 16)
            return own_cpu(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()

    def role(self, name: str, keys: Keys) -> float:
        quiet = ["--log-level", "WARNING"]
        streamer = ["-m", "streamer", *quiet]
        if name == "archive":
            archive = self.data / keys.run / "archive"
            written = lambda: any(f.stat().st_size for f in archive.glob("rollouts-*.jsonl.gz"))  # noqa: E731
            return self.until([*streamer, "archive", *self.common], written, "the archiver")
        if name == "metrics":
            port = free_port()
            argv = [*streamer, "metrics", *self.common, "--port", str(port)]
            return self.until(argv, lambda: _serves(port), "the exporter")
        if name == "up":
            argv = ["-c", UP, *quiet, "up", *self.common, "--no-progress", "--producers", "1"]
            return self.until(argv, None, "up", line="streamer up: run")
        extra = ["--out", str(self.data / "run.png")] if name == "plot" else []
        return self.to_exit(*streamer, name, *self.common, *extra)

    def torch_import(self) -> float:
        return self.to_exit("-c", "import torch")


def _serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def one_round(tree: Path, url: str, client, workdir: Path) -> dict[str, float]:
    """Every role once from ``tree``, on a run of its own; CPU seconds per role."""
    keys = C.fresh_keys("start")
    data = Path(tempfile.mkdtemp(prefix="data-", dir=workdir))
    seed(client, keys)
    starter = Starter(tree, url, keys, data)
    try:
        cpu = {name: starter.role(name, keys) for name in ROLES}  # archive first: samples reads it
        cpu["import torch"] = starter.torch_import()
    finally:
        C.drop_run(client, keys)
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_server_args(ap)
    ap.set_defaults(repeats=3)
    ap.add_argument("--baseline", type=Path, help="another source tree to start the same roles from")
    args = C.parse_args(ap, argv, quick="one repeat (smoke test)", repeats=1)
    trees = {"this": C.ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in trees}
    start = time.monotonic()
    with C.server_url(args) as url, tempfile.TemporaryDirectory(prefix="streamer-startup-") as tmp:
        client = C.bench_client(url)
        for repeat in range(args.repeats):
            for side in C.alternate(list(trees), repeat):
                runs[side].append(one_round(trees[side], url, client, Path(tmp)))
        client.close()
    med = {side: {k: C.median([r[k] for r in rs]) for k in rs[0]} for side, rs in runs.items()}
    print(f"CPU seconds (user + system) of each role's own process, medians over {args.repeats} repeat(s)")
    headers = ["role", "this tree"] + (["baseline", "this / baseline"] if args.baseline else [])
    rows = []
    for name in (*ROLES, "import torch"):
        row = [name, med["this"][name]]
        if args.baseline:
            row += [med["baseline"][name], med["this"][name] / med["baseline"][name]]
        rows.append(row)
    C.print_table(headers, rows)
    if args.baseline:
        ratios = {f"{n}_vs_baseline": med["this"][n] / med["baseline"][n] for n in ROLES}
    else:
        ratios = {f"{n}_vs_torch_import": med["this"][n] / med["this"]["import torch"] for n in ROLES}
    C.print_ratios(ratios)
    print(f"bench took {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
