"""Staleness along the version tree (consumers/lineage.py), by hand."""

from consumers.lineage import Lineage


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
