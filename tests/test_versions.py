"""The version publisher: CPU weights are lent to the writer and the learner waits for it
to read them before changing them; a snapshot's memory (GPU weights) is reused for the next;
no version is written with another's weights."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from trainer_data import make_group

from consumers import versions
from consumers.batch import collate
from consumers.learner import Learner
from consumers.versions import VersionPublisher, snapshot
from streamer import demo, weights
from streamer.config import TrainerSection

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


@pytest.mark.parametrize("lent", [True, False])  # False: as GPU weights are, snapshots
def test_versions_submitted_back_to_back_are_each_written_with_their_own_weights(
    client, keys, tmp_path, monkeypatch, lent
):
    model = demo.build_model(seed=2)
    if not lent:
        monkeypatch.setattr(versions, "_on_cpu", lambda model: False)
    publisher = VersionPublisher(client, keys, root=tmp_path, keep_versions=10, protect=lambda: -1)
    expected = {}
    try:
        for version in range(1, 7):  # faster than the writer: some wait, some reuse a spare
            publisher.until_read()  # as the learner does before its optimizer step
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


def test_a_learner_waits_for_the_writer_to_read_lent_weights_before_changing_them(
    client, keys, tmp_path, monkeypatch
):
    learner = Learner(demo.build_model(seed=2), TrainerSection(lr=1e-2))
    publisher = VersionPublisher(client, keys, root=tmp_path, keep_versions=10, protect=lambda: -1)
    learner.before_update = publisher.until_read  # as the trainer wires them
    # the writer starts reading only once the learner waits for it, or has finished its step
    proceed = threading.Event()

    class Watched(threading.Event):
        def wait(self, timeout=None):
            if not self.is_set():
                proceed.set()
            return super().wait(timeout)

    publisher._read = Watched()
    publisher._read.set()
    save = weights.save

    def held_save(*args, **kwargs):
        assert proceed.wait(60), "the learner neither waited nor finished its step"
        return save(*args, **kwargs)

    monkeypatch.setattr(weights, "save", held_save)
    rng = random.Random(0)
    batch = collate([make_group(rng, model=learner.model, rewards=(1.0, 0.0, 0.5, 0.0)) for _ in range(2)])
    lent = {n: t.clone() for n, t in learner.model.state_dict().items()}
    try:
        publisher.submit(learner.model, version=1, step=1)
        step = threading.Thread(target=lambda: (learner.train_step(batch), proceed.set()))
        step.start()
        step.join(60)
        assert not step.is_alive(), "the learner is still waiting"
        publisher.drain()
    finally:
        proceed.set()
        publisher.close()
    written = demo.build_model(seed=3)
    weights.load_into(written, weights.version_dir(tmp_path, 1))
    for name, t in written.state_dict().items():
        assert torch.equal(t, lent[name]), name
    assert any(not torch.equal(t, lent[n]) for n, t in learner.model.state_dict().items()), "no step taken"
