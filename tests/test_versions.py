"""The version publisher's snapshots: a published snapshot's memory is reused for the next,
and no version is written with another's weights."""

from __future__ import annotations

import pytest
import torch

from consumers import versions
from consumers.versions import VersionPublisher, snapshot
from streamer import demo, weights

TIED = ("model.embed_tokens.weight", "lm_head.weight")


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


@pytest.mark.parametrize("chunk", [1 << 22, 100])  # tensors whole; every tensor cut in slices
def test_a_snapshot_reuses_a_spare_of_the_same_layout_and_keeps_tied_weights_tied(monkeypatch, chunk):
    monkeypatch.setattr(versions, "_CHUNK", chunk)
    model = demo.build_model(seed=1)
    first = snapshot(model)
    ptrs = {n: t.data_ptr() for n, t in first.state.items()}
    _bump(model, 0.5)
    second = snapshot(model, first)
    assert {n: t.data_ptr() for n, t in second.state.items()} == ptrs  # no new memory
    for name, t in model.state_dict().items():
        assert torch.equal(second.state[name], t), name
    assert second.state[TIED[0]] is second.state[TIED[1]]
    other = snapshot(demo.build_model(seed=1, hidden=32), second)  # another layout: a fresh copy
    assert other.state[TIED[0]].shape[1] == 32 and other.state[TIED[0]].data_ptr() not in ptrs.values()


def test_versions_submitted_back_to_back_are_each_written_with_their_own_weights(client, keys, tmp_path):
    model = demo.build_model(seed=2)
    publisher = VersionPublisher(client, keys, root=tmp_path, keep_versions=10, protect=lambda: -1)
    expected = {}
    try:
        for version in range(1, 7):  # faster than the writer: some wait, some reuse a spare
            _bump(model, 0.25)
            expected[version] = {n: t.clone() for n, t in model.state_dict().items()}
            publisher.submit(model, version=version, step=version)
        publisher.drain()
    finally:
        publisher.close()
    for version, state in expected.items():
        loaded = demo.build_model(seed=3)
        weights.load_into(loaded, weights.version_dir(tmp_path, version))
        for name, t in loaded.state_dict().items():
            assert torch.equal(t, state[name]), (version, name)
