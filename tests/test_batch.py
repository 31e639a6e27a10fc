"""Groups -> padded tensors: alignment of weights and log-probs, masks, advantages, splits."""

from __future__ import annotations

import random

import pytest
import torch
from samples import group
from trainer_data import make_group

from consumers.batch import collate
from schemas import Sample


def _sample(prompt, completion, logprobs, *, reward, version=0, mask=None) -> Sample:
    return Sample.build(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        reward=reward,
        finish_reason="stop",
        version=version,
        mask=mask,
    )


def test_alignment_with_different_prompt_lengths():
    a = _sample([11, 12, 13], [21, 22], [-0.1, -0.2], reward=1.0)
    b = _sample([14], [23, 24, 25, 26], [-1, -2, -3, -4], reward=0.0, mask=[1, 0, 1, 1])
    batch = collate([group([a, b])], pad_id=0)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22], [14, 23, 24, 25, 26]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1] * 5]
    # target t is input t+1: a's completion tokens 21, 22 are targets 2, 3
    assert batch.targets.tolist() == [[12, 13, 21, 22], [23, 24, 25, 26]]
    assert batch.weights.tolist() == [[0, 0, 1, 1], [1, 0, 1, 1]]
    torch.testing.assert_close(batch.sampler_logp, torch.tensor([[0, 0, -0.1, -0.2], [-1, 0, -3, -4]]))
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-4)
    assert batch.num_tokens == 5


def test_padding_and_group_advantages():
    short = _sample([1, 2], [3], [-0.5], reward=2.0, version=1)
    long = _sample([1, 2, 4, 5], [6, 7], [-1, -1], reward=0.0, version=2)
    g1 = group([short, long], group_id="g1")
    g2 = group([long, short, short], group_id="g2")
    batch = collate([g1, g2], pad_id=9, std_normalize=False)
    assert batch.input_ids.shape == (5, 6)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 9, 9, 9]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch.weights[0].tolist() == [0, 1, 0, 0, 0]  # nothing trained on padding
    # centred per group: g1 mean 1, g2 mean 4/3
    assert batch.advantages.tolist() == pytest.approx([1, -1, -4 / 3, 2 / 3, 2 / 3])


def test_split_trims_padding_and_keeps_rows():
    rng = random.Random(3)
    groups = [make_group(rng, rewards=(1, 0, 1), finishes=["stop", "length", "stop"]) for _ in range(3)]
    batch = collate(groups)
    parts = batch.split(4)
    assert sum(p.size for p in parts) == batch.size == 9
    assert torch.equal(torch.cat([p.advantages for p in parts]), batch.advantages)
    for p in parts:
        assert p.input_ids.shape[1] == p.attention_mask.sum(-1).max()
        assert p.weights.shape[1] == p.input_ids.shape[1] - 1 == p.sampler_logp.shape[1]
    assert sum(p.num_tokens for p in parts) == batch.num_tokens
    assert len(batch.split(100)) == 9
    assert [ix.tolist() for ix in batch.micro_batches(rows=4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert [ix.tolist() for ix in batch.micro_batches(rows=0)] == [list(range(9))]


def test_collate_rejects_nothing_to_train():
    with pytest.raises(ValueError):
        collate([])
