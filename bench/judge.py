"""Judge: a producer's groups/s with ``producer.reward = "judge"`` against the same without.

One process runs the real Producer in-process (the demo model through LocalSampler, one
torch thread, G = 16 completions a group) against a private valkey-server, admission and
backpressure wide open (no trainer), with 1 and then 4 rows in flight (``--concurrency``).
Sides, alternated repeat by repeat:

    no judge      the demo reward (a Python function)
    judge         the built-in judge (``kind = "chat"``) against a stub OpenAI-compatible
                  judge that answers each request after a fixed ``--latency`` (default
                  20 ms) and grades as the demo reward does; a group's G requests are in
                  flight at once over the judge's pooled client
    judge, a group a request   ``kind = "batch"`` against the same stub's scoring
                  endpoint, which answers a group's G completions in one reply after the
                  same ``--latency``: one request a group
    judge, a client per call   (``--unpooled``) the same with a new HTTP client for every
                  request: what the pool saves
    wait only     an async reward that waits ``--latency`` and grades as the demo reward
                  does: the judge's latency alone, no HTTP, through the same
                  ``reward.concurrency`` slots

The stub is an asyncio server in a process of its own: it shares no interpreter lock with
the producer, and its CPU per request is small next to the client's (on a 2-core machine it
still shares the cores). Each side runs ``--groups`` groups a repeat, after a warm-up run
of each; groups/s is groups over the wall time of ``Producer.run``. A ratio is the median
over repeats of no-judge groups/s over judge groups/s, per rows in flight (goal: <= 1.5).
With one row in flight the judge's latency adds to every group; with more, other rows
sample while one waits for its scores, as far as ``reward.concurrency`` (the config's 32, or
``--reward-concurrency``) lets a group's G calls of every row wait at once.

    python bench/judge.py                 # 60 groups a side, 3 repeats (~1 minute)
    python bench/judge.py --unpooled      # also the client-per-call side (slow)
    python bench/judge.py --concurrency 8 --reward-concurrency 128   # latency hidden
    python bench/judge.py --quick         # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

GOAL = 1.5  # no-judge groups/s over judge groups/s, at most
WARM = 5  # groups of each side's warm-up run
GRADED = re.compile(r"Reference answer: (.*?)\n\nResponse: (.*?)\n\nReply with", re.S)


# ---------------------------------------------------------------- the stub judge


def serve_stub(latency: float, ports, stop) -> None:
    """An OpenAI-compatible judge on a free port (sent on ``ports``) until ``stop`` is set:
    each request answered after ``latency`` seconds, "1" when the response starts with the
    reference answer's digit, else "0". An asyncio server, HTTP/1.1 keep-alive: its own CPU
    per request stays small next to the client's it measures."""
    import asyncio

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                fields = dict(
                    line.split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ":" in line
                )
                length = {k.strip().lower(): v.strip() for k, v in fields.items()}["content-length"]
                body = json.loads(await reader.readexactly(int(length)))
                if "completions" in body:  # kind = "batch": a group's completions at once
                    answer = body["row"]["answer"]
                    scores = [1 if text.strip()[:1] == answer else 0 for text in body["completions"]]
                    await asyncio.sleep(latency)  # the reward model's time to answer
                    raw = json.dumps({"scores": scores})
                else:
                    found = GRADED.search(body["messages"][0]["content"])
                    right = found is not None and found.group(2).strip()[:1] == found.group(1).strip()
                    await asyncio.sleep(latency)  # the judge model's time to answer
                    message = {"role": "assistant", "content": "1" if right else "0"}
                    raw = json.dumps(
                        {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}
                    )
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(raw)}\r\n\r\n{raw}".encode()
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.close()

    asyncio.run(main())


class StubJudge:
    """:func:`serve_stub` in a process of its own, for the ``with`` block."""

    def __init__(self, latency: float):
        ctx = multiprocessing.get_context("spawn")
        ports, self.stop = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=serve_stub, args=(latency, ports, self.stop), daemon=True)
        self.proc.start()
        self.url = f"http://127.0.0.1:{ports.get(timeout=60)}/v1"

    def __enter__(self) -> StubJudge:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------- the sides


def unpooled(cfg):
    """The judge of ``cfg`` with a new HTTP client for every request."""
    from producers.judge import Judge

    class Unpooled(Judge):
        async def _post(self, body: bytes) -> bytes:
            once = Judge(self.cfg, concurrency=1)  # its own client, for this request alone
            try:
                return await once._post(body)
            finally:
                await once.aclose()

    return Unpooled(cfg.reward.judge, concurrency=cfg.reward.concurrency)


def run_side(cfg, client, task, sampler, groups: int, concurrency: int) -> tuple[float, float]:
    """Wall and CPU seconds of a producer publishing ``groups`` groups on a fresh run with
    ``concurrency`` rows in flight."""
    from producers.producer import Producer
    from streamer.config import replace
    from streamer.keys import TRAINER_GROUP, Keys

    run = f"judge{uuid.uuid4().hex[:8]}"
    cfg = replace(cfg, run={"name": run}, producer={"max_groups": groups, "concurrency": concurrency})
    keys = Keys(run)
    client.xgroup_create(keys.traj, TRAINER_GROUP, id="0", mkstream=True)  # read as in a run
    producer = Producer(cfg, client=client, producer_id="bench", task=task, sampler=sampler)
    watch = C.Stopwatch(client)
    watch.start()
    producer.run()
    watch.stop()
    assert producer.published == groups, f"published {producer.published} of {groups}"
    C.drop_run(client, keys)
    return watch.wall, watch.cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=60, help="groups per side per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per side; medians reported")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds the stub judge takes per request")
    ap.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default="1,4",
        help="producer.concurrency (rows in flight), comma separated",
    )
    ap.add_argument("--unpooled", action="store_true", help="also the side with a client per request")
    ap.add_argument(
        "--reward-concurrency", type=int, default=0, help="reward.concurrency (default: the config's)"
    )
    args = C.parse_args(ap, argv, quick="8 groups, 1 repeat", groups=8, repeats=1)

    import dataclasses

    import anyio
    import torch

    from producers.components import build, load_reward
    from streamer import demo
    from streamer.config import replace
    from streamer.server import EmbeddedServer

    torch.set_num_threads(1)
    began = time.monotonic()
    with (
        StubJudge(args.latency) as stub,
        tempfile.TemporaryDirectory(prefix="streamer-judge-") as tmp,
        EmbeddedServer(Path(tmp) / "valkey") as srv,
    ):
        client = C.bench_client(srv.url)
        cfg = replace(
            demo.config(),
            run={"redis_url": srv.url, "data_dir": tmp},
            trainer={"max_staleness": 1_000_000},  # no trainer: admission never closes
            bus={"max_unacked": 1_000_000},
            reward={"judge": {"url": stub.url, "model": "stub", "retries": 0}},
        )
        if args.reward_concurrency:
            cfg = replace(cfg, reward={"concurrency": args.reward_concurrency})
        task, sampler = build(cfg)
        judged = replace(cfg, producer={"reward": "judge"})
        batched = replace(judged, reward={"judge": {"kind": "batch", "url": stub.url + "/score"}})
        rewards = {
            "no judge": task.reward_fn,
            "judge": load_reward(judged, "judge"),
            "judge, a group a request": load_reward(batched, "judge"),
        }
        if args.unpooled:
            rewards["judge, a client per call"] = unpooled(judged)

        async def wait_only(row, text, sample=None):
            await anyio.sleep(args.latency)
            return demo.reward(row, text)

        rewards["wait only"] = wait_only
        tasks = {k: dataclasses.replace(task, reward_fn=fn, reward_path=k) for k, fn in rewards.items()}
        sides = [(c, k) for c in args.concurrency for k in tasks]
        for c, k in sides:  # model, scripts and connections warm before timing
            run_side(cfg, client, tasks[k], sampler, WARM, c)
        runs: dict[tuple[int, str], list[tuple[float, float]]] = {s: [] for s in sides}
        for r in range(args.repeats):
            for c, k in C.alternate(sides, r):
                runs[c, k].append(run_side(cfg, client, tasks[k], sampler, args.groups, c))
        client.close()
    n = args.groups
    print(
        f"demo model in-process, G={cfg.producer.group_size}, stub judge {1000 * args.latency:g} ms a request, "
        f"reward.concurrency {cfg.reward.concurrency}, {n} groups a side, {args.repeats} repeats "
        "(medians; ratios: medians of paired repeats)"
    )
    C.print_table(
        ["rows in flight", "side", "groups/s", "ms/group", "process CPU ms/group"],
        [
            [c, k, n / C.median([w for w, _ in v]), 1000 * C.median([w for w, _ in v]) / n]
            + [1000 * C.median([cpu for _, cpu in v]) / n]
            for (c, k), v in runs.items()
        ],
    )
    ratios, goals = {}, {}
    for c in args.concurrency:
        name = f"no_judge_vs_judge_c{c}"
        ratios[name] = paired(runs[c, "judge"], runs[c, "no judge"])
        goals[name] = f"goal <= {GOAL:g}: {'met' if ratios[name] <= GOAL else 'NOT met'}"
        batch = f"no_judge_vs_batch_judge_c{c}"
        ratios[batch] = paired(runs[c, "judge, a group a request"], runs[c, "no judge"])
        goals[batch] = f"goal <= {GOAL:g}: {'met' if ratios[batch] <= GOAL else 'NOT met'}"
        ratios[f"no_judge_vs_wait_only_c{c}"] = paired(runs[c, "wait only"], runs[c, "no judge"])
        if args.unpooled:
            ratios[f"pooled_vs_client_per_call_c{c}"] = paired(
                runs[c, "judge, a client per call"], runs[c, "judge"]
            )
    print(f"bench took {time.monotonic() - began:.0f} s")
    C.print_ratios(ratios, goals=goals)
    return 0


def paired(slow: list[tuple[float, float]], fast: list[tuple[float, float]]) -> float:
    """Median over repeats of wall(slow) / wall(fast): the fast side's groups/s over the slow one's."""
    return C.median([s[0] / f[0] for s, f in zip(slow, fast, strict=True)])


if __name__ == "__main__":
    sys.exit(main())
