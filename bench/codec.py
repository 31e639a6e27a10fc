"""Codec: the msgspec wire schema vs JSON and pickle, on the same trajectory groups.

For G=8 samples x 512 and x 4096 tokens (a quarter prompt, a float32 log-prob per
completion token), each format encodes and decodes the same groups and then turns them
into tensor-ready arrays (token ids and log-probs as numpy arrays):

  msgspec          schemas.encode / schemas.decode(TrajectoryGroup): packed int32/float32
                   bytes, validated on decode; arrays are zero-copy views + concatenate
  json             orjson if importable, else the stdlib json; token ids and log-probs
                   as lists of numbers; arrays via np.asarray
  pickle (lists)   pickle of the same dict of lists (what a PipelineRL-style transport
                   carries); arrays via np.asarray
  pickle (packed)  pickle of a dict holding the same packed bytes as msgspec: shows what
                   packing alone buys; unsafe to load from a shared server all the same

MB/s are of the msgspec payload size (the same logical data for every format), so the
columns compare directly. Pickle is used ONLY here, as the thing we compare against.

    python bench/codec.py              # defaults (well under a minute)
    python bench/codec.py --mb 200     # bigger
    python bench/codec.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import json
import pickle  # ONLY as a baseline we compare against; never on the wire
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C

from schemas import TrajectoryGroup, decode, encode

try:
    import orjson

    JSON_NAME, json_dumps, json_loads = "orjson", orjson.dumps, orjson.loads
except ImportError:  # the stdlib, with compact separators
    JSON_NAME = "json (stdlib)"
    json_loads = json.loads

    def json_dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def packed_dict(group: TrajectoryGroup) -> dict:
    """The group as a dict whose token ids and log-probs stay packed bytes."""
    d = C.as_plain_dict(group)
    d["samples"] = [
        {**s, "input_ids": bytes(g.tokens), "logprobs": bytes(g.logprobs)}
        for s, g in zip(d["samples"], group.samples, strict=True)
    ]
    return d


def packed_tensor_ready(group: dict) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([np.frombuffer(s["input_ids"], "<i4") for s in group["samples"]])
    lps = np.concatenate([np.frombuffer(s["logprobs"], "<f4") for s in group["samples"]])
    return ids, lps


@dataclass(frozen=True)
class Format:
    """How one format turns a group into bytes, bytes into an object, an object into arrays."""

    name: str
    prepare: Callable
    enc: Callable
    dec: Callable
    arrays: Callable
    slow: bool = False  # measured on a share of the groups (--slow-share) to bound the run


FORMATS = [
    Format("msgspec", lambda g: g, encode, lambda b: decode(b, TrajectoryGroup), C.tensor_ready),
    Format(JSON_NAME, C.as_plain_dict, json_dumps, json_loads, C.plain_tensor_ready, slow=True),
    Format(
        "pickle (lists)",
        C.as_plain_dict,
        lambda d: pickle.dumps(d, pickle.HIGHEST_PROTOCOL),
        pickle.loads,
        C.plain_tensor_ready,
        slow=True,
    ),
    Format(
        "pickle (packed)",
        packed_dict,
        lambda d: pickle.dumps(d, pickle.HIGHEST_PROTOCOL),
        pickle.loads,
        packed_tensor_ready,
    ),
]


def measure(fmt: Format, objs: list, *, chunk: int = 64) -> tuple[float, float, float, int]:
    """Seconds to encode, decode and build arrays from all ``objs``; bytes of one encoding.

    Works through ``chunk`` groups at a time, as a consumer reading COUNT 64 does, so no
    format is charged for keeping every decoded group alive at once.
    """
    enc = dec = arr = 0.0
    for i in range(0, len(objs), chunk):
        t0 = time.perf_counter()
        blobs = [fmt.enc(o) for o in objs[i : i + chunk]]
        t1 = time.perf_counter()
        decoded = [fmt.dec(b) for b in blobs]
        t2 = time.perf_counter()
        for d in decoded:
            fmt.arrays(d)
        t3 = time.perf_counter()
        enc, dec, arr = enc + t1 - t0, dec + t2 - t1, arr + t3 - t2
        del blobs, decoded
    return enc, dec, arr, len(fmt.enc(objs[0]))


def bench_size(args, tokens: int) -> tuple[list, dict[str, float]]:
    probe = len(encode(C.make_groups(1, tokens=tokens, group_size=args.group_size)[0]))
    n = max(2, int(args.mb * 1e6 / probe))
    groups = C.make_groups(n, tokens=tokens, group_size=args.group_size)
    n_slow = max(2, int(n * args.slow_share))
    objs = {f.name: [f.prepare(g) for g in groups[: n_slow if f.slow else n]] for f in FORMATS}
    total = {f.name: sum(len(encode(g)) for g in groups[: len(objs[f.name])]) for f in FORMATS}
    runs: dict[str, list[tuple]] = {f.name: [] for f in FORMATS}
    for r in range(args.repeats):
        for f in C.alternate(FORMATS, r):
            runs[f.name].append(measure(f, objs[f.name]))
    rows, enc_dec = [], {}
    for f in FORMATS:
        enc, dec, arr = (C.median([run[i] for run in runs[f.name]]) for i in range(3))
        size = runs[f.name][0][3]
        enc_dec[f.name] = (enc + dec) / len(objs[f.name])  # seconds per group
        speeds = [C.mb(total[f.name] / seconds) for seconds in (enc, dec, enc + dec, enc + dec + arr)]
        rows.append([tokens, f.name, len(objs[f.name]), size / 1000, *speeds])
    return rows, enc_dec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_payload_args(ap, mb=40.0, mb_help="msgspec payload MB per repeat")
    ap.add_argument("--slow-share", type=float, default=0.1, help="share of groups the slow formats process")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; medians reported")
    return C.parse_args(ap, argv, quick="tiny sizes for a smoke test", mb=0.5, repeats=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began, rows, ratios = time.monotonic(), [], {}
    print(
        f"G={args.group_size}, {args.repeats} repeats (medians), ~{args.mb:g} MB of msgspec "
        f"payload per repeat; MB/s of the msgspec payload size"
    )
    for tokens in args.sizes:
        r, enc_dec = bench_size(args, tokens)
        rows += r
        for name, key in (
            (JSON_NAME, "json"),
            ("pickle (lists)", "pickle_lists"),
            ("pickle (packed)", "pickle_packed"),
        ):
            ratios[f"msgspec_vs_{key}_{tokens}"] = enc_dec[name] / enc_dec["msgspec"]
    C.print_table(
        [
            "tokens",
            "format",
            "groups",
            "KB/group",
            "encode MB/s",
            "decode MB/s",
            "enc+dec MB/s",
            "+arrays MB/s",
        ],
        rows,
    )
    print(f"took {time.monotonic() - began:.0f} s; ratios are encode+decode speed, msgspec / other")
    C.print_ratios(ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
