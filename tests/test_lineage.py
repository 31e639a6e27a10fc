"""Staleness along the version tree (consumers/lineage.py), by hand."""

from consumers.lineage import Lineage
from schemas import Sample, Span, TrajectoryGroup


def test_ancestors_discarded_branches_and_unknown_versions():
    tree = Lineage()
    for version, step in [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]:
        tree.add(version, step)
    tree.add(5, 2)  # a restart restored the checkpoint at step 2: v3, v4 are discarded
    tree.add(6, 3)
    assert tree.distance(6) == 0 and tree.distance(5) == 1 and tree.distance(2) == 1
    assert tree.distance(0) == 3  # an ancestor: steps, not the 6 version numbers
    assert tree.distance(4) == (4 - 2) + (3 - 2)  # down the dead branch, up to now
    assert tree.distance(3) == 2
    tree.add(7, 1)  # a second restart went back further (an older checkpoint)
    assert tree.distance(6) == (3 - 1) + 0 and tree.distance(4) == (4 - 1) + 0
    assert tree.distance(1) == 0 and tree.distance(0) == 1
    assert tree.distance(-3) == 10  # not on the stream any more: version numbers apart


def test_tokens_behind_counts_each_sampled_span_by_its_own_version():
    tree = Lineage()
    for version in range(4):
        tree.add(version, version)
    two = Sample.build(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5, 6, 7],
        logprobs=[-0.1] * 5,
        reward=1.0,
        finish_reason="stop",
        version=1,
        spans=[Span(0, 3, 1), Span(3, 5, 2)],  # the weights changed after the third token
    )
    one = Sample.build(
        prompt_ids=[1],
        completion_ids=[3, 4],
        logprobs=[-0.1] * 2,
        reward=0.0,
        finish_reason="stop",
        version=3,
    )
    group = TrajectoryGroup(
        group_id="0:0", row=0, epoch=0, producer_id="p", samples=[two, one], policy_version=1, created_at=0.0
    )
    assert tree.tokens_behind([group]) == {2: 3, 1: 2, 0: 2}
