"""The demo on a local Valkey cluster with replicas, optionally through a master's failover.

    python bench/cluster_demo.py                 # 3 masters + a replica each, bus.min_replicas 1
    python bench/cluster_demo.py --failover 100  # SIGKILL the run's master once version 100 is out
    python bench/cluster_demo.py --steps 30      # a short run

`streamer up` (trainer, evaluator, exporter, archiver, 2 producers) runs the built-in demo
against ``redis+cluster://`` with ``bus.min_replicas = 1``. With ``--failover V`` the master
serving the run's slot is SIGKILLed once the policy stream holds version V; the cluster
promotes its replica; the old master is restarted and rejoins as the new master's replica.
Prints the run's steps, wall time, held-out eval accuracy and the failover's timing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from streamer import demo
from streamer.config import replace
from streamer.connection import connect
from streamer.keys import Keys
from streamer.server import LocalCluster


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if got := cond():
                return got
        except Exception:  # a node going down or coming back
            pass
        time.sleep(0.05)
    sys.exit(f"{what}: not within {timeout:.0f}s")


def run(args, d: Path, cluster: LocalCluster, keys: Keys) -> tuple[dict, dict]:
    """`streamer up` on the cluster (and the failover, if asked); its curve and the failover."""
    cfg = replace(demo.config(), run={"name": keys.run}, bus={"min_replicas": 1})
    failover: dict = {}

    def fail_over() -> None:
        client = connect(cluster.url)
        wait(lambda: client.xlen(keys.policy) > args.failover, 1800, f"version {args.failover}")
        victim = cluster.master_of(keys.traj)
        victim.kill()
        killed = time.monotonic()
        wait(lambda: cluster.master_of(keys.traj) != victim, 120, "the replica promoted")
        failover["promoted_after_s"] = round(time.monotonic() - killed, 2)
        victim.start()
        wait(lambda: cluster.replica_in_sync(victim), 120, "the old master back as a replica")
        failover["old_master_back_after_s"] = round(time.monotonic() - killed, 2)
        failover["at_version"] = args.failover

    extra = ["--redis-url", cluster.url, "--steps", str(args.steps), "--producers", "2"]
    curve = C.run_up(cfg, d, *extra, timeout=3600, during=fail_over if args.failover else None)
    return curve, failover


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=demo.STEPS, help="trainer steps")
    ap.add_argument("--failover", type=int, default=0, help="kill the run's master at this version; 0 = no")
    ap.add_argument("--node-timeout", type=float, default=2.0, help="cluster-node-timeout, seconds")
    args = ap.parse_args(argv)
    keys = Keys("clusterdemo")
    with tempfile.TemporaryDirectory(prefix="streamer-cluster-") as tmp:
        d = Path(tmp)
        with LocalCluster(d / "cluster", masters=3, replicas=1, node_timeout=args.node_timeout) as cluster:
            curve, failover = run(args, d, cluster, keys)
    evals = {int(v): a for v, a in curve["eval_accuracy_by_version"].items()}
    last = max(evals) if evals else None
    print(
        f"cluster: 3 masters + 1 replica each, bus.min_replicas 1, cluster-node-timeout {args.node_timeout:g}s"
    )
    print(f"steps trained      {curve['steps']}")
    print(f"wall time          {curve['wall']:.0f}s (up: {curve['wall_seconds']:.0f}s)")
    print(f"held-out accuracy  {evals.get(last, float('nan')):.2f} at version {last}")
    print(f"reached 0.8        {curve['reached_seconds']}")
    if failover:
        print(f"failover           {failover}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
