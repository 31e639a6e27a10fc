"""The tests' in-process producer: a small run config, the producer, what it left behind.

``run_cfg`` samples G = 2 completions of 2 tokens on the demo model with one torch thread;
``counters`` sums the rollout counters of every metrics event the producer sent.
"""

from __future__ import annotations

from producers.components import build
from producers.producer import Producer
from schemas import MetricsEvent, decode
from streamer.config import RunConfig, replace

SMALL = {"group_size": 2, "min_group_size": 2, "max_new_tokens": 2, "torch_threads": 1}


def run_cfg(keys, redis_url, tmp_path, *, max_seq_len: int = 0, **producer) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={**SMALL, **producer},
        trainer={"groups_per_step": 1000, "max_seq_len": max_seq_len},
    )


def make_producer(cfg: RunConfig, client, rollout=None) -> Producer:
    task, sampler = build(cfg)
    return Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler, rollout=rollout)


def counters(client, keys) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, f in client.xrange(keys.metrics):
        for k, v in decode(f[b"d"], MetricsEvent).values.items():
            out[k] = out.get(k, 0.0) + v
    return out


def nothing_held(client, keys) -> None:
    assert client.zcard(keys.leases) == 0 and client.scard(keys.lease_slots) == 0, "a lease was left"
    assert int(client.get(keys.admitted) or 0) == client.xlen(keys.traj), "an admission slot leaked"
