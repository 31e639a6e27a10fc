"""Where a demo producer's CPU per group goes: the producer loop against the bare work.

One process, one torch thread, a private valkey-server (AOF everysec, as `up` runs it).
Four sides, alternated round by round so that load from elsewhere hits all of them:

    producer          the real Producer (claim, admission, weights check, rollout, episode
                      checks, publish script, backpressure check, metrics event), the demo
                      model sampling through LocalSampler; admission and backpressure wide
                      open (no trainer), the trainer's group on the stream as in a run
    producer canned   the same loop with a sampler that returns canned completions: what
                      the loop costs around the engine call
    bare              what the bare loop of bench/cpu_per_version.py does per group (its
                      ``bare_samples``): render, one ``LocalSampler.sample`` of G
                      completions, score and pack each
    bare canned       the same with the canned sampler

No trainer runs, so no side loads weights (in a run each producer loads every version:
bench/cpu_per_version.py counts that). CPU seconds per group, this process's and the
server's (INFO cpu); and what the producer asks of the server per group in steady state:
round trips counted at the client (a command, a pipeline or a script call is one; the
heartbeat thread, per 2 s rather than per group, is not counted), and the commands the
server ran for them (INFO commandstats, commands inside scripts included). Both are the
difference between a run of N groups and a (second) warm-up run of 20, over N - 20 groups, so
that a run's fixed start and stop calls are left out. The split:

    loop around the engine     producer canned - bare canned   (Redis, thread hops, checks)
    engine call in the loop    (producer - producer canned) - (bare - bare canned)

    python bench/producer_overhead.py            # 300 groups a side, 3 rounds (~25 s here)
    python bench/producer_overhead.py --quick    # 30 groups, 1 round (~6 s)
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C
from cpu_per_version import bare_samples

SIDES = ("producer", "producer canned", "bare", "bare canned")
WARM = 20  # groups of the warm-up run of each path
CONNECTION_COMMANDS = ("info", "client|", "hello", "ping")  # per connection or the bench's own


class Canned:
    """A LocalSampler stand-in that returns the same G completions for every prompt."""

    def __init__(self, real, completions):
        self.model, self.stop_ids, self.max_parallel = real.model, real.stop_ids, 1
        self.real, self.completions = real, completions

    def sample(self, prompt_ids, **kwargs):
        return list(self.completions)

    def sample_many(self, prompts, **kwargs):
        return [list(self.completions) for _ in prompts]

    def load_weights(self, directory) -> None:
        self.real.load_weights(directory)

    def close(self) -> None:
        pass


def producer_side(cfg, client, task, sampler, groups: int, trips: C.RoundTrips) -> tuple[int, dict]:
    """Run ``groups`` groups; the round trips and server commands (by name) the run took."""
    from producers.producer import Producer
    from streamer.config import replace
    from streamer.keys import TRAINER_GROUP, Keys

    run = f"po{uuid.uuid4().hex[:8]}"
    cfg = replace(cfg, run={"name": run}, producer={"max_groups": groups})
    # the trainer's group, so that the room check reads it as in a run
    client.xgroup_create(Keys(run).traj, TRAINER_GROUP, id="0", mkstream=True)
    producer = Producer(cfg, client=client, producer_id="bench", task=task, sampler=sampler)
    before, commands = trips.count, server_commands(client)
    producer.run()
    after = server_commands(client)
    assert producer.published == groups, f"published {producer.published} of {groups}"
    return trips.count - before, {k: after[k] - commands.get(k, 0) for k in after}


def server_commands(client) -> dict[str, int]:
    """Calls per command name so far (INFO commandstats), without CONNECTION_COMMANDS."""
    stats = client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}
    return {k: n for k, n in calls.items() if not k.startswith(CONNECTION_COMMANDS)}


def bare_side(cfg, task, sampler, groups: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(groups):
        bare_samples(task, sampler, cfg.producer, rng.choice(task.rows), seed=seed + i, version=0)


def steady(
    run: tuple[int, dict], warm: tuple[int, dict], extra_groups: int
) -> tuple[float, dict[str, float]]:
    """Round trips and commands per group of the groups ``run`` had beyond ``warm``'s."""
    (trips, commands), (warm_trips, warm_commands) = run, warm
    per = {k: round((v - warm_commands.get(k, 0)) / extra_groups, 2) for k, v in commands.items()}
    return round((trips - warm_trips) / extra_groups, 2), per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=300, help="groups per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = C.parse_args(ap, argv, quick="30 groups, 1 round", groups=30, rounds=1)
    if args.groups <= WARM:
        ap.error(f"--groups must be above the {WARM} of the warm-up run")

    import torch

    from producers.components import build
    from streamer import demo
    from streamer.config import replace
    from streamer.server import EmbeddedServer

    torch.set_num_threads(1)
    cpu = {s: 0.0 for s in SIDES}
    server = {s: 0.0 for s in SIDES}
    with (
        tempfile.TemporaryDirectory(prefix="streamer-po-") as tmp,
        EmbeddedServer(Path(tmp) / "valkey") as srv,
    ):
        client = C.bench_client(srv.url)
        trips = C.RoundTrips(client)
        cfg = replace(
            demo.config(),
            run={"redis_url": srv.url, "data_dir": tmp},
            trainer={"max_staleness": 1_000_000},  # no trainer: admission never closes
            bus={"max_unacked": 1_000_000},
        )
        task, real = build(cfg)
        p = cfg.producer
        prompt = task.renderer.render(task.rows[0])
        kw = dict(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens)
        canned = Canned(real, real.sample(prompt, n=p.group_size, **kw, seed=0))
        bare_side(cfg, task, real, WARM, seed=0)  # warm both paths before timing
        producer_side(cfg, client, task, real, WARM, trips)  # also loads the scripts
        warm_trips, warm_commands = producer_side(cfg, client, task, real, WARM, trips)
        per_group: tuple[float, dict[str, float]] | None = None
        for r in range(args.rounds):
            for side in C.alternate(SIDES, r):
                sampler = canned if side.endswith("canned") else real
                watch = C.Stopwatch(client)
                watch.start()
                if side.startswith("producer"):
                    got = producer_side(cfg, client, task, sampler, args.groups, trips)
                    per_group = steady(got, (warm_trips, warm_commands), args.groups - WARM)
                else:
                    bare_side(cfg, task, sampler, args.groups, seed=1000 * r)
                watch.stop()
                cpu[side] += watch.cpu
                server[side] += watch.server
    n = args.groups * args.rounds
    ms = {s: 1000 * cpu[s] / n for s in SIDES}
    srv_ms = {s: 1000 * server[s] / n for s in SIDES}
    C.print_table(
        ["side", "groups", "process CPU ms / group", "server CPU ms / group", "total ms / group"],
        [[s, n, ms[s], srv_ms[s], ms[s] + srv_ms[s]] for s in SIDES],
    )
    total = {s: ms[s] + srv_ms[s] for s in SIDES}
    loop = total["producer canned"] - total["bare canned"]
    engine = (ms["producer"] - ms["producer canned"]) - (ms["bare"] - ms["bare canned"])
    print(f"the loop around the engine call: {loop:.2f} ms / group (this process and the server)")
    print(f"the engine call inside the loop, over the bare call: {engine:.2f} ms / group")
    round_trips, commands = per_group
    top = ", ".join(f"{k} {v:g}" for k, v in sorted(commands.items(), key=lambda kv: -kv[1]) if v)
    print(f"round trips to the server per group (steady state): {round_trips:g}")
    print(
        f"server commands per group (INFO commandstats, in scripts too): {sum(commands.values()):g} ({top})"
    )
    C.print_ratios(
        {
            "producer_vs_bare_per_group": total["producer"] / total["bare"],
            "canned_producer_vs_bare_per_group": total["producer canned"] / total["bare canned"],
        },
        counts={"round_trips_per_group": round_trips},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
