"""How far a sample's weights are from the weights it trains: staleness along the version tree.

Version numbers are never reused, so a number names one set of weights; but after a crash
the trainer restores an older checkpoint and publishes it under a new number, and the
versions it had published after that checkpoint are *discarded*: no later weights descend
from them. Counting staleness as a difference of version numbers then lies both ways: an
ancestor looks older than it is (the numbers jumped), a discarded version looks close while
its weights took a branch that was thrown away.

So a sample's **staleness** is the number of trainer steps between the weights that
sampled it and the current weights, walking the tree of versions (each ``WeightSync`` says
the trainer step its weights are at):

- ancestor (the current weights descend from it): ``current_step - its_step``;
- discarded (published after the checkpoint a restart went back to, at ``fork``):
  ``(its_step - fork) + (current_step - fork)`` — down its branch to the fork, then up;
- unknown (no longer on the policy stream): the difference of version numbers.

A group's staleness is that of its stalest sample version. The trainer drops a group whose
staleness exceeds ``max_staleness``; the ``staleness_*`` train metrics report it.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas import TrajectoryGroup, WeightSync


class Lineage:
    """The versions published on a run's policy stream, as a tree of trainer steps."""

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}  # version -> trainer step of its weights
        self.forks: dict[int, int] = {}  # discarded version -> step its branch left the lineage
        self.version, self.step = -1, -1  # the newest version and its step

    def load(self, syncs: Iterable[WeightSync]) -> Lineage:
        """Replay the policy stream (oldest first)."""
        for s in syncs:
            self.add(s.version, s.step)
        return self

    def add(self, version: int, step: int) -> None:
        """A version is published (``step``: the trainer step its weights are at)."""
        if step <= self.step:  # weights restored from a checkpoint at `step`: a fork
            for v, s in self.steps.items():
                if v in self.forks:
                    self.forks[v] = min(self.forks[v], step)
                elif s > step:
                    self.forks[v] = step
        self.steps[version] = step
        self.version, self.step = max(self.version, version), step

    def distance(self, version: int) -> int:
        """Trainer steps between ``version``'s weights and the newest weights."""
        step = self.steps.get(version)
        if step is None:
            return self.version - version
        fork = self.forks.get(version)
        if fork is None:
            return self.step - step
        return (step - fork) + (self.step - fork)

    def tokens_behind(self, groups: Iterable[TrajectoryGroup]) -> dict[int, int]:
        """Sampled tokens of ``groups`` by the distance of the version that sampled each one."""
        out: dict[int, int] = {}
        for g in groups:
            for s in g.samples:
                for start, end, version in _runs(s):
                    d = self.distance(version)
                    out[d] = out.get(d, 0) + end - start
        return out

    def staleness(self, group: TrajectoryGroup) -> int:
        """The distance of the group's stalest sample version."""
        versions = {s.version for s in group.samples} | {group.policy_version}
        return max(self.distance(v) for v in versions)


def _runs(sample) -> list[tuple[int, int, int]]:
    """(start, end, version) of a sample's sampled tokens: its spans, or all of it."""
    if sample.spans is None:
        return [(0, sample.completion_len, sample.version)]
    return [(sp.start, sp.end, sp.version) for sp in sample.spans]
