"""Producers SIGKILLed mid-row, 5 times (two waves; the second wave dies on rows the first
wave's leases handed back): in the end every row of the epoch is published exactly once and
no partial group is ever published. tests/test_producer.py covers one such kill.

The producers sample from a fake inference server (the test double for vLLM) that answers
a seeded number of requests and then holds the rest, so each victim dies while its row is
being sampled, holding the lease.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from bounds import RUN, START
from harness import report, run_config_in
from waits import wait_until

from schemas import TrajectoryGroup
from streamer.bus import entry_event
from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow

ROWS, G = 12, 4
WAVES = (3, 2)  # victims per wave


def test_producers_sigkilled_mid_row_publish_every_row_exactly_once(
    redis_url, keys: Keys, procs, inference, tmp_path
):
    server, backend = inference
    rng = random.Random(20261208)
    client = connect(redis_url)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(
        "".join(f'{{"prompt": "{i % 5}+{i % 4}=", "answer": "{i % 5 + i % 4}"}}\n' for i in range(ROWS))
    )
    config = run_config_in(
        tmp_path,
        keys,
        sampler_url=server.url,
        producer={
            "group_size": G,
            "min_group_size": G,
            "dataset": str(dataset),
            "epochs": 1,
            "lease_seconds": 1.0,
            "remote_retries": 0,
        },
        trainer={"groups_per_step": 1000},
        bus={"max_unacked": 1000},
    )
    kills, died_holding, tickets_killed = 0, 0, Counter()
    for wave, victims in enumerate(WAVES):
        # wave 0 publishes a few rows, then sampling stalls; wave 1 stalls at once, on the
        # rows wave 0's expired leases handed back (they are handed out first). Wave 1 starts
        # only once every lease of wave 0 has expired by server time, so its first claim
        # must sweep them onto the requeue list and take them before any fresh row.
        if wave:
            _wait_expired(client, keys, set(tickets_killed), procs)
        backend.hold_after(rng.randint(1, 4) if wave == 0 else 0)
        held_before = len(backend.held)
        names = [f"w{wave}v{i}" for i in range(victims)]
        for name in names:
            procs.start(name, "produce", "--config", str(config), "--redis-url", redis_url, "--id", name)
        wait_until(
            lambda n=held_before + victims, names=names: (
                len(backend.held) >= n and _holding(client, keys, names)
            ),
            timeout=START,
            what=f"wave {wave}: {victims} producers stuck mid-row",
            watch=procs,
        )
        for name in rng.sample(names, len(names)):
            owned = _leases_of(client, keys, name)
            procs.procs[name].kill()
            assert procs.procs[name].wait(10) == -9
            kills += 1
            died_holding += bool(owned) and _leases_of(client, keys, name) == owned  # lease outlived it
            tickets_killed.update(owned)
            time.sleep(rng.uniform(0.0, 0.2))
    assert kills >= 5

    backend.open()
    procs.start("heir", "produce", "--config", str(config), "--redis-url", redis_url, "--id", "heir")
    assert procs.wait("heir", RUN) == 0, procs.tails()

    entries = client.xrange(keys.traj)
    groups = [entry_event(f, TrajectoryGroup) for _, f in entries]
    rows = Counter((g.epoch, g.row) for g in groups)
    partial = sum(len(g.samples) != G for g in groups)
    lost = ROWS - len(rows)
    duplicated = sum(n - 1 for n in rows.values())
    report(
        "producer-sigkill",
        kills=kills,
        died_holding_a_lease=died_holding,
        rows=ROWS,
        published=len(groups),
        lost=lost,
        duplicated=duplicated,
        partial=partial,
        rows_killed_twice=sum(n > 1 for n in tickets_killed.values()),
        crashed=sum(p.returncode not in (0, -9) for p in procs.procs.values()),
    )
    assert sorted(rows) == [(0, r) for r in range(ROWS)] and duplicated == 0
    assert partial == 0 and client.xlen(keys.dead) == 0
    assert died_holding == kills, "a victim was not mid-row when it died"
    assert max(tickets_killed.values()) == 2  # the second wave died on handed-back rows
    assert client.zcard(keys.leases) == 0 and client.llen(keys.requeue) == 0
    assert client.scard(keys.lease_slots) == 0
    assert int(client.get(keys.admitted)) == ROWS  # the dead producers' slots came back
    assert {g.producer_id for g in groups} >= {"heir"}


def _wait_expired(client, keys: Keys, tickets: set[int], procs) -> None:
    """Wait until every lease in ``tickets`` has expired by the server's clock (the clock the
    claim script compares against), or was swept already."""

    def expired() -> bool:
        secs, micros = client.time()
        now = secs + micros / 1e6
        scores = [client.zscore(keys.leases, t) for t in tickets]
        return all(s is None or s < now for s in scores)

    wait_until(expired, timeout=30, what=f"the leases of tickets {sorted(tickets)} to expire", watch=procs)


def _leases_of(client, keys: Keys, owner: str) -> set[int]:
    return {int(t) for t, o in client.hgetall(keys.lease_owner).items() if o.decode() == owner}


def _holding(client, keys: Keys, names: list[str]) -> bool:
    return all(_leases_of(client, keys, n) for n in names)
