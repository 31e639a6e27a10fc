"""Wire events built by hand: a sample and a group with small defaults, any field replaceable."""

from __future__ import annotations

from schemas import Sample, TrajectoryGroup

SAMPLE = {
    "prompt_ids": [5, 6, 7],
    "completion_ids": [8, 9],
    "logprobs": [-0.1, -2.5],
    "reward": 1.0,
    "finish_reason": "stop",
    "version": 2,
}


def sample(**over) -> Sample:
    """:data:`SAMPLE` with ``over``'s fields instead."""
    return Sample.build(**(SAMPLE | over))


def group(samples: list[Sample] | None = None, **over) -> TrajectoryGroup:
    """A group of ``samples`` (default: two, rewards 1 and 0) tagged with their oldest version;
    ``over`` replaces any field."""
    samples = samples or [sample(), sample(reward=0.0)]
    fields = {"group_id": "0:1", "row": 1, "epoch": 0, "producer_id": "p", "created_at": 1.0} | over
    fields.setdefault("policy_version", min(s.version for s in samples))
    return TrajectoryGroup(samples=samples, **fields)
