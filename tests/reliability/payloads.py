"""Bad stream payloads for the fuzz test, seeded: random bytes and mutations of valid events.

Each generator returns bytes meant to be unusable; :func:`bad_payloads` keeps only those a
consumer must refuse (checked with the same decoder, plus the trainer's usability check for
trajectory groups) and counts the mutants that happened to stay valid.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import msgspec
from trainer_data import make_group

from consumers.filters import unusable
from schemas import (
    DecodeError,
    MetricsEvent,
    TrajectoryGroup,
    WeightSync,
    decode,
    encode,
)
from streamer import demo

VOCAB = len(demo.tokenizer())
_raw = msgspec.msgpack.Encoder()
_any = msgspec.msgpack.Decoder()
OTHER_TYPES = ["x", 7, -1, 2.5, float("nan"), None, True, [1, 2], {"a": 1}, b"\x00\x01"]
HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdb\x7f\xff\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01",
    b"\xdc\xff\xff",
]


def valid_group(rng: random.Random) -> TrajectoryGroup:
    return make_group(rng, rewards=(1.0, 0.0, 0.0, 1.0))


def valid_metrics(rng: random.Random, step: int) -> MetricsEvent:
    return MetricsEvent(
        axis=rng.choice(["train", "rollout", "eval"]),
        step=step,
        source="fuzz",
        values={"reward_mean": rng.random(), "tokens": float(rng.randint(1, 99))},
    )


def usable(payload: bytes, as_type) -> bool:
    """Would the consumer accept this payload? (The trainer also checks usability.)"""
    try:
        event = decode(payload, as_type)
    except DecodeError:
        return False
    return not (as_type is TrajectoryGroup and unusable(event, vocab_size=VOCAB))


# ---------------------------------------------------------------- mutations


def _bitflip(rng, raw: bytes, _) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _truncate(rng, raw: bytes, _) -> bytes:
    return raw[: rng.randrange(len(raw))]


def _random_bytes(rng, _raw_, __) -> bytes:
    return rng.randbytes(rng.randint(0, 300))


def _huge_length(rng, raw: bytes, _) -> bytes:
    cut = rng.randrange(len(raw))
    return raw[:cut] + rng.choice(HUGE_HEADERS) + raw[cut : cut + rng.randint(0, 8)]


def _wrong_type(rng, _raw_, tree) -> bytes:
    node, key = _random_slot(rng, tree)
    node[key] = rng.choice([v for v in OTHER_TYPES if type(v) is not type(node[key])])
    return _raw.encode(tree)


def _drop_field(rng, _raw_, tree) -> bytes:
    node, key = _random_slot(rng, tree, dicts_only=True)
    del node[key]
    return _raw.encode(tree)


def _wrong_tag(rng, _raw_, tree) -> bytes:
    other = rng.choice(
        [
            WeightSync(version=1, step=1, uri="file:///x", sha256="0" * 64),
            MetricsEvent(axis="train", step=1, values={}, source="x"),
            make_group(rng),
        ]
    )
    raw = encode(other)
    return raw if rng.random() < 0.5 else _raw.encode({**tree, "type": rng.choice(["bogus", "", 3])})


def _schema(rng, _raw_, tree) -> bytes:
    tree["schema"] = rng.choice([0, 2, 99, -1, 2**40])
    return _raw.encode(tree)


def _random_slot(rng, tree, dicts_only: bool = False):
    """A random (container, key) inside the decoded tree."""
    node, key = tree, rng.choice(list(tree))
    while isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.6:
        child = node[key]
        if dicts_only and isinstance(child, list):
            child = rng.choice(child)
            if not isinstance(child, dict) or not child:
                break
            node, key = child, rng.choice(list(child))
            continue
        node, key = child, rng.choice(list(child)) if isinstance(child, dict) else rng.randrange(len(child))
    return node, key


# ---------------------------------------------------------------- trajectory-specific


def _group_field(rng, _raw_, tree) -> bytes:
    """A sample or group field set to a value the contract forbids."""
    sample = rng.choice(tree["samples"])
    lp, tok = sample["logprobs"], sample["tokens"]
    nan, inf = b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f"
    choice = rng.randrange(10)
    if choice == 0:
        sample["reward"] = rng.choice([float("nan"), float("inf"), -float("inf"), 1e39, -1e300])
    elif choice == 1:
        sample[rng.choice(["version"])] = -rng.randint(1, 2**31)
    elif choice == 2:
        tree[rng.choice(["policy_version", "row", "epoch"])] = -rng.randint(1, 100)
    elif choice == 3:
        sample["logprobs"] = lp[:-4] if rng.random() < 0.5 else lp + lp[:4]  # one too few / many
    elif choice == 4:
        sample["tokens"] = tok[: -rng.randint(1, 3)]  # not a multiple of 4
    elif choice == 5:
        sample["prompt_len"] = rng.choice([0, -1, len(tok) // 4, 10**9])
    elif choice == 6:
        sample["logprobs"] = rng.choice([nan, inf]) + lp[4:]
    elif choice == 7:
        bad_id = rng.choice([-1, VOCAB, 2**31 - 1]).to_bytes(4, "little", signed=True)
        sample["tokens"] = tok[:-4] + bad_id
    elif choice == 8:
        sample["mask"] = b"\x01" * (len(lp) // 4 + 1)
    else:
        tree["samples"] = rng.choice([[], "x", [1, 2]])
    return _raw.encode(tree)


def big_bad_group(rng: random.Random, mib: float) -> bytes:
    """A ~``mib`` MiB group whose log-probs are one short: refused after reading it all."""
    tree = _any.decode(encode(valid_group(rng)))
    n = int(mib * 2**20 / 8)
    for s in tree["samples"][:1]:
        s["tokens"], s["prompt_len"] = s["tokens"][:4] * (n + 1), 1
        s["logprobs"] = b"\x00\x00\x00\x00" * (n - 1)
    return _raw.encode(tree)


COMMON: list[Callable] = [
    _bitflip,
    _truncate,
    _random_bytes,
    _huge_length,
    _wrong_type,
    _drop_field,
    _wrong_tag,
    _schema,
]


def bad_payloads(rng: random.Random, as_type, n: int) -> tuple[list[tuple[str, bytes]], Counter]:
    """``n`` (kind, payload) pairs the consumer of ``as_type`` must refuse; also the count of
    generated mutants that were still valid (discarded)."""
    mutations = COMMON + ([_group_field] * 4 if as_type is TrajectoryGroup else [])
    out, still_valid = [], Counter()
    step = 0
    while len(out) < n:
        step += 1
        base = encode(valid_group(rng) if as_type is TrajectoryGroup else valid_metrics(rng, step))
        mutate = rng.choice(mutations)
        payload = mutate(rng, base, _any.decode(base))
        if usable(payload, as_type):
            still_valid[mutate.__name__.strip("_")] += 1
        else:
            out.append((mutate.__name__.strip("_"), payload))
    return out, still_valid
