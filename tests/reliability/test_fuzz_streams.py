"""10,000 bad payloads into the trajectory and metrics streams, under the real trainer and
exporter processes: every one is dead-lettered with its reason, neither process crashes,
both keep working on the good entries interleaved, and their memory stays bounded.

Payloads (tests/reliability/payloads.py): random bytes, truncated and bit-flipped msgpack,
wrong types, missing fields, huge length headers, wrong tags, unknown schema versions,
NaN/inf/overflowing rewards, negative versions, token/log-prob length mismatches, NaN
log-probs, token ids outside the vocabulary, entries without the payload field, and a few
~1 MiB payloads. Mutants that happen to stay valid are published too: they must be
trained or rejected like any group, and the model must stay finite.
"""

from __future__ import annotations

import random
import urllib.request
from collections import Counter

import msgspec
import pytest
import torch
from bounds import START
from harness import audit, audited_client, report, rss_mb, run_config_in
from payloads import (
    COMMON,
    VOCAB,
    bad_payloads,
    big_bad_group,
    usable,
    valid_group,
    valid_metrics,
)
from prometheus_client.parser import text_string_to_metric_families
from waits import wait_until

from consumers import checkpoint
from consumers.filters import GroupFilter, unusable
from schemas import DeadLetter, MetricsEvent, TrajectoryGroup, decode, encode
from streamer.bus import FIELD, entry, entry_event, unacked
from streamer.config import TrainerSection
from streamer.keys import METRICS_GROUP
from streamer.server import free_port

pytestmark = pytest.mark.slow

N_TRAJ, N_METRICS, N_BIG, N_NO_FIELD = 6000, 4000, 12, 20
TRAINER = {"groups_per_step": 4, "checkpoint_every": 2, "max_staleness": 1000, "steps": 0}
CHUNK = 500


def _publish(client, stream: str, entries: list[dict]) -> list[str]:
    ids = []
    for lo in range(0, len(entries), CHUNK):
        pipe = client.pipeline(transaction=False)
        for fields in entries[lo : lo + CHUNK]:
            pipe.xadd(stream, fields)
        ids += [i.decode() for i in pipe.execute()]
    return ids


def _interleave(rng, bad: list[dict], good: list[dict]) -> list[tuple[bool, dict]]:
    out = [(False, b) for b in bad]
    for g in good:
        out.insert(rng.randrange(len(out) + 1), (True, g))
    return out


def _accepted(payload: bytes, judge: GroupFilter) -> bool:
    g = decode(payload, TrajectoryGroup)
    return unusable(g, vocab_size=VOCAB) is None and judge(g, version=0).accepted


def _events_applied(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "streamer_exporter_events_total"
    )


def _dead(client, keys) -> dict[tuple[str, str], str]:
    out = {}
    for _, f in client.xrange(keys.dead):
        letter = entry_event(f, DeadLetter)
        out[(letter.stream, letter.entry_id)] = letter.reason
    return out


def test_fuzzed_streams_are_dead_lettered_and_consumers_keep_working(redis_url, keys, procs, tmp_path):
    rng = random.Random(20261210)
    client = audited_client(redis_url, keys)
    port = free_port()
    config = run_config_in(
        tmp_path, keys, trainer=TRAINER, bus={"block_seconds": 0.5, "max_unacked": 100_000}
    )
    args = ("--config", str(config), "--redis-url", redis_url)
    trainer = procs.start("trainer", "train", *args)
    exporter = procs.start("metrics", "metrics", *args, "--port", str(port))
    judge = GroupFilter.from_config(TrainerSection(**TRAINER))

    # warm up: both processes at work before the baseline memory reading
    warm = [entry(valid_group(rng)) for _ in range(8)]
    _publish(client, keys.traj, warm)
    _publish(client, keys.metrics, [entry(valid_metrics(rng, i)) for i in range(50)])
    wait_until(
        lambda: client.xlen(keys.policy) >= 3 and _events_applied(port) >= 50,
        timeout=START,
        what="2 trainer steps and 50 metrics events applied",
        watch=procs,
    )
    rss = {"trainer": [rss_mb(trainer.pid)], "metrics": [rss_mb(exporter.pid)]}

    traj_bad, traj_valid = bad_payloads(rng, TrajectoryGroup, N_TRAJ - N_BIG)
    traj_bad += [("big", big_bad_group(rng, 1.0)) for _ in range(N_BIG)]
    met_bad, met_valid = bad_payloads(rng, MetricsEvent, N_METRICS - N_NO_FIELD)
    bad_entries = {
        "traj": [{FIELD: p} for _, p in traj_bad] + [{"x": b"no payload field"}] * (N_NO_FIELD // 2),
        "metrics": [{FIELD: p} for _, p in met_bad] + [{"x": b"no payload field"}] * (N_NO_FIELD // 2),
    }
    good_traj = [entry(valid_group(rng)) for _ in range(24)]
    good_met = [entry(valid_metrics(rng, 100 + i)) for i in range(200)]
    accepted = len(warm) + len(good_traj)  # every clean group is accepted (reward variance)
    stream_of = {"traj": keys.traj, "metrics": keys.metrics}
    bad_ids = {"traj": [], "metrics": []}
    applied_expected = 50 + len(good_met)
    for half in (0, 1):
        for name, good in (("traj", good_traj), ("metrics", good_met)):
            bad = bad_entries[name][half::2]
            mixed = _interleave(rng, bad, good[half::2])
            ids = _publish(client, stream_of[name], [fields for _, fields in mixed])
            bad_ids[name] += [i for i, (is_good, _) in zip(ids, mixed) if not is_good]
        total_bad = len(bad_ids["traj"]) + len(bad_ids["metrics"])
        wait_until(
            lambda n=total_bad: client.xlen(keys.dead) >= n,
            timeout=240,
            what=f"{total_bad} dead letters (half {half})",
            watch=procs,
        )
        rss["trainer"].append(rss_mb(trainer.pid))
        rss["metrics"].append(rss_mb(exporter.pid))
    # the valid mutants too, as they would arrive: trained/rejected and applied like any event
    mutants = [{FIELD: p} for p in _valid_mutants(rng, traj_valid, TrajectoryGroup)]
    accepted += sum(_accepted(m[FIELD], judge) for m in mutants)
    extra = (-accepted) % TRAINER["groups_per_step"]  # a whole number of steps in the end
    mutants += [entry(valid_group(rng)) for _ in range(extra)]
    _publish(client, keys.traj, mutants)
    met_mutants = [{FIELD: p} for p in _valid_mutants(rng, met_valid, MetricsEvent)]
    _publish(client, keys.metrics, met_mutants)
    applied_expected += len(met_mutants)
    steps = (accepted + extra) // TRAINER["groups_per_step"]
    wait_until(
        lambda: (
            client.xlen(keys.policy) >= 1 + steps
            and unacked(client, keys.traj) == 0
            and _events_applied(port) >= applied_expected
        ),
        timeout=120,
        what=f"{steps} steps, every trajectory acknowledged, {applied_expected} events applied",
        watch=procs,
    )
    alive = trainer.poll() is None and exporter.poll() is None
    exits = [procs.stop("trainer"), procs.stop("metrics")]

    dead = _dead(client, keys)
    missing = [(n, i) for n in bad_ids for i in bad_ids[n] if not dead.get((stream_of[n], i))]
    wrongly = len(dead) - sum(len(v) for v in bad_ids.values())
    ckpt = tmp_path / "data" / keys.run / "checkpoints"
    result = audit(client, keys, ckpt, TrainerSection(**TRAINER))
    path, meta = checkpoint.latest(ckpt)
    finite = all(torch.isfinite(t).all() for t in _weights(path))
    reasons = Counter(r.split(":")[0][:40] for r in dead.values())
    report(
        "fuzz-streams",
        payloads=sum(len(v) for v in bad_ids.values()),
        traj=len(bad_ids["traj"]),
        metrics=len(bad_ids["metrics"]),
        dead_lettered=len(dead),
        not_dead_lettered=len(missing),
        good_dead_lettered=wrongly,
        valid_mutants_published=len(mutants) + len(met_mutants),
        trained=result.trained,
        lost=len(result.lost),
        duplicated=len(result.duplicated),
        crashed=int(not alive) + sum(c != 0 for c in exits),
        weights_finite=finite,
        rss_mb={k: [round(x) for x in v] for k, v in rss.items()},
        top_reasons=dict(reasons.most_common(6)),
    )
    assert alive and exits == [0, 0], procs.tails()
    assert not missing and wrongly == 0
    assert not result.lost and not result.duplicated and result.waiting == 0
    assert meta.step == steps and finite
    for name, (base, mid, end) in rss.items():
        assert end - base < 64 and end - mid < 32, f"{name} memory grows: {rss[name]} MiB"
    metrics_group = next(g for g in client.xinfo_groups(keys.metrics) if g["name"].decode() == METRICS_GROUP)
    assert metrics_group["pending"] == 0 and metrics_group["lag"] == 0


def _valid_mutants(rng, counts: Counter, as_type) -> list[bytes]:
    """Fresh mutants that stay valid (as many as the generator discarded, at most 200)."""
    out, want = [], min(sum(counts.values()), 200)
    while len(out) < want:
        base = encode(
            valid_group(rng) if as_type is TrajectoryGroup else valid_metrics(rng, 10_000 + len(out))
        )
        p = rng.choice(COMMON)(rng, base, msgspec.msgpack.decode(base))
        if usable(p, as_type):
            out.append(p)
    return out


def _weights(path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(path / "model" / "model.safetensors").values())


def test_trim_while_a_consumer_acknowledges(client, keys):
    """Found by the fuzz: the trainer's trim after a checkpoint raced its feed thread
    dead-lettering (acknowledging) entries; the pending list emptied between XINFO GROUPS
    and XPENDING and trim_acked crashed the trainer. The acknowledgement is injected at
    exactly that moment here, against the real server."""
    from streamer.bus import trim_acked

    ids = [client.xadd(keys.traj, {FIELD: b"x"}).decode() for _ in range(4)]
    client.xgroup_create(keys.traj, "trainer", id="0")
    client.xreadgroup("trainer", "t", {keys.traj: ">"}, count=4)

    class AcksInBetween:
        def __getattr__(self, name):
            return getattr(client, name)

        def xinfo_groups(self, stream):
            groups = client.xinfo_groups(stream)  # says 4 pending
            client.xack(stream, "trainer", *ids)  # ... and now none are
            return groups

    trimmed = trim_acked(AcksInBetween(), keys.traj)
    report("trim-race", acknowledged_in_between=4, trimmed=trimmed, crashed=0)
    assert trimmed == 4 and client.xlen(keys.traj) == 0
