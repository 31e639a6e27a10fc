"""Weight updates with long generations in flight: drain vs keep vs abort (producer.inflight_updates).

    python bench/inflight.py                 # a real vLLM (python3 dev.py vllm builds it)
    python bench/inflight.py --quick         # a short run of the same
    python bench/inflight.py --engine fake   # the project's test server (no vLLM): the protocol's own cost

One inference server, one sampler with ``--concurrency`` requests in flight at all times
(each ``--tokens`` long, ``n`` = 2, prompts sharing a prefix of two KV blocks), and a new
version loaded every ``--every`` seconds for ``--seconds`` seconds, in each mode in turn
(the modes alternate their order from one round to the next). For each mode it prints:

- tokens/s: completion tokens received per second of the run;
- stall per update: seconds from the update's start until generation resumed;
- staleness in tokens: per completion token, how many versions older its stamp is than the
  newest version when its completion came back (mean), and the share of tokens sampled by
  an older version than that.

The ``ratios:`` line gives each mode's tokens/s and stall against drain's. On a GPU box the
same command measures vLLM's CUDA build (``STREAMER_VLLM`` names another requirement).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from producers import engines
from producers.fake_server import FakeCompletionsServer
from producers.reload import ServerVersions, server_id
from producers.remote_sampler import RemoteSampler
from producers.samplers import Completion
from streamer import demo, vllm_server, weights
from streamer.connection import connect
from streamer.server import free_port

MODES = ("drain", "keep", "abort")
POSITIONS = 1024


def _prompts(n: int) -> list[list[int]]:
    tok = demo.tokenizer()
    usable = [i for i in range(len(tok)) if i not in (tok.eos_token_id, tok.pad_token_id)]
    rng = random.Random(0)
    prefix = [rng.choice(usable) for _ in range(64)]
    return [prefix + [rng.choice(usable) for _ in range(8)] for _ in range(n)]


def _fake_backend(tokens: int):
    def backend(body: dict) -> list[Completion]:
        k = int(body["max_tokens"])
        return [Completion([3] * k, [-0.5] * k, "length")] * int(body.get("n", 1))

    return backend


class Server:
    """The engine under test: a real vLLM, or the test server with a per-token delay."""

    def __init__(self, kind: str, root: Path, tokens: int):
        self.kind, self.root = kind, root
        self.model_dir = demo.save_for_engine(root / "model", seed=0, positions=POSITIONS)
        if kind == "vllm":
            self.proc = vllm_server.VllmServer(
                self.model_dir,
                log_path=root / "vllm.log",
                port=free_port(),
                max_model_len=POSITIONS,
                block_size=32,
            )
            self.proc.start()
            self.proc.wait_ready(_prompts(1)[0], timeout=600)
            self.url = self.proc.url
        else:
            self.fake = FakeCompletionsServer(_fake_backend(tokens), token_delay=0.002).start()
            self.url = self.fake.url

    def stop(self) -> None:
        if self.kind == "vllm":
            self.proc.stop()
        else:
            self.fake.stop()


def run_mode(server: Server, client, mode: str, args, version0: int) -> dict:
    """One mode for ``args.seconds``: its figures, and the last version it loaded."""
    keys = C.fresh_keys("inflight")
    sampler = RemoteSampler(
        base_url=server.url,
        model=str(server.model_dir),
        stop_ids=[],
        engine=engines.Vllm(),
        concurrency=args.concurrency,
        extra_body={"min_tokens": args.tokens} if server.kind == "vllm" else None,
    )
    versions = ServerVersions(client, keys, server.url, lock_seconds=300, mode=mode)
    client.set(keys.served(server_id(server.url)), version0)
    sampler.attach(versions)
    prompts = _prompts(args.concurrency)
    stop = threading.Event()
    lock = threading.Lock()
    tokens, stale, older = [0], [0], [0]
    stalls: list[float] = []
    newest = [version0]

    def worker(i: int) -> None:
        while not stop.is_set():
            out = sampler.sample(prompts[i], n=2, temperature=1.0, top_p=1.0, max_new_tokens=args.tokens)
            with lock:
                for c in out:
                    for a, b, v in c.runs():
                        tokens[0] += b - a
                        stale[0] += (newest[0] - v) * (b - a)
                        older[0] += (b - a) if v < newest[0] else 0

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    version = version0
    try:
        while time.monotonic() - start < args.seconds:
            time.sleep(args.every)
            version += 1
            if server.kind == "vllm":
                directory = weights.version_dir(server.root, version)
                if not directory.exists():
                    weights.write_version(_model(version), server.root, version, untie=True)
            else:
                directory = server.root / f"v{version}"
            versions.ensure(version, lambda d=directory: sampler.reload(d), engine=sampler)
            with lock:
                newest[0] = version
            stalls.append(versions.last_stall)
        elapsed = time.monotonic() - start
        with lock:
            counted = tokens[0]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        sampler.close()
        versions.close()
        C.drop_run(client, keys)
    return {
        "tokens_per_s": counted / elapsed,
        "stall": statistics.median(stalls) if stalls else 0.0,
        "stale_tokens": stale[0] / max(tokens[0], 1),
        "older_share": older[0] / max(tokens[0], 1),
        "updates": len(stalls),
        "version": version,
    }


def _model(version: int):
    return demo.build_model(100 + version, **demo.ENGINE_SIZE, tie=False, positions=POSITIONS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_server_args(ap)
    ap.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    ap.add_argument("--seconds", type=float, default=20.0, help="per mode and round")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between updates")
    ap.add_argument("--tokens", type=int, default=600, help="completion length")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = C.parse_args(
        ap, None, quick="a short run of each mode", seconds=4.0, every=1.0, tokens=200, rounds=1
    )
    if args.engine == "vllm" and vllm_server.python() is None:
        sys.exit("no vLLM virtualenv: python3 dev.py vllm (or --engine fake)")
    t0 = time.monotonic()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="streamer-inflight-") as tmp, C.server_url(args) as url:
        client = connect(url)
        server = Server(args.engine, Path(tmp), args.tokens)
        version = 0
        try:
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    res = run_mode(server, client, mode, args, version)
                    version = res["version"]
                    results[mode].append(res)
                    print(
                        f"round {r + 1} {mode:<5}  {res['tokens_per_s']:8.0f} tokens/s  "
                        f"stall {res['stall']:.3f}s per update ({res['updates']})  "
                        f"staleness {res['stale_tokens']:.3f} versions per token  "
                        f"older than newest {res['older_share']:.1%}",
                        flush=True,
                    )
        finally:
            server.stop()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(
        f"engine {args.engine}, {args.concurrency} requests of {args.tokens} tokens (n=2), update every {args.every}s"
    )
    for m in MODES:
        print(
            f"{m:<5}  {med[m]['tokens_per_s']:8.0f} tokens/s  stall {med[m]['stall']:.3f}s  "
            f"staleness {med[m]['stale_tokens']:.3f}  older {med[m]['older_share']:.1%}"
        )
    ratios = {}
    for m in ("keep", "abort"):
        ratios[f"{m}_vs_drain_tokens_per_s"] = med[m]["tokens_per_s"] / max(
            med["drain"]["tokens_per_s"], 1e-9
        )
        ratios[f"{m}_vs_drain_stall"] = med[m]["stall"] / max(med["drain"]["stall"], 1e-9)
    C.print_ratios(ratios)
    print(f"bench took {time.monotonic() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
