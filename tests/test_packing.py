"""Token-budget micro-batches: rows bucketed by length up to ``trainer.micro_batch_tokens``,
packed without padding where the model's attention keeps packed rows apart; the gradient is
the padded path's."""

from __future__ import annotations

import random

import pytest
import torch

from consumers.batch import Batch, collate, pack
from consumers.learner import Learner
from schemas import Sample, TrajectoryGroup
from streamer import demo
from streamer.config import TrainerSection

VOCAB = len(demo.tokenizer())


def _groups(rng: random.Random, lengths: list[tuple[int, int]], per_group: int = 4) -> list[TrajectoryGroup]:
    """Groups of samples with the given (prompt, completion) lengths, random tokens."""
    samples = [
        Sample.build(
            prompt_ids=[rng.randrange(3, VOCAB) for _ in range(p)],
            completion_ids=[rng.randrange(3, VOCAB) for _ in range(c)],
            logprobs=[-rng.uniform(0.5, 3.0) for _ in range(c)],
            reward=float(rng.random() < 0.5) + 0.1 * i,
            finish_reason="stop",
            version=0,
        )
        for i, (p, c) in enumerate(lengths)
    ]
    chunks = [samples[i : i + per_group] for i in range(0, len(samples), per_group)]
    return [
        TrajectoryGroup(
            group_id=f"g{i}", row=i, epoch=0, producer_id="t", samples=s, policy_version=0, created_at=0.0
        )
        for i, s in enumerate(chunks)
    ]


def _mixed_batch(seed: int = 0) -> Batch:
    rng = random.Random(seed)
    lengths = [(rng.randint(2, 12), rng.choice([1, 3, 8, 20, 40])) for _ in range(12)]
    return collate(_groups(rng, lengths))


def test_token_budget_micro_batches_hold_every_row_once_within_the_budget():
    batch = _mixed_batch()
    lengths = batch.attention_mask.sum(-1)
    for packed in (False, True):
        micros = batch.micro_batches(tokens=64, packed=packed)
        rows = torch.cat(micros).sort().values
        assert rows.tolist() == list(range(batch.size)), "every row exactly once"
        for ix in micros:
            cost = int(lengths[ix].sum()) if packed else len(ix) * int(lengths[ix].max())
            assert cost <= 64 or len(ix) == 1, (packed, ix, lengths[ix])
        padded_cost = sum(len(ix) * int(lengths[ix].max()) for ix in micros)
        assert padded_cost < batch.size * int(lengths.max()), "bucketing pads less than one padded batch"
    assert len(batch.micro_batches(tokens=64, packed=True)) < len(batch.micro_batches(tokens=64))
    # a row longer than the budget trains alone; no budget: slices of rows as before
    assert all(len(ix) == 1 for ix in batch.micro_batches(tokens=1))
    assert [ix.tolist() for ix in batch.micro_batches(rows=5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_packing_lays_rows_end_to_end_and_back():
    batch = _mixed_batch(1)
    mb = batch.rows(torch.tensor([0, 3, 7]))
    p = pack(mb)
    lengths = mb.attention_mask.sum(-1).tolist()
    assert p.input_ids.shape == (1, sum(lengths)), "no padding"
    starts = [sum(lengths[:i]) for i in range(3)]
    for r, (start, n) in enumerate(zip(starts, lengths)):
        assert p.input_ids[0, start : start + n].tolist() == mb.input_ids[r, :n].tolist()
        assert p.position_ids[0, start : start + n].tolist() == list(range(n))
    assert torch.equal(p.unpack(p.pack(mb.weights)), mb.weights), "weights survive the round trip"
    assert float(p.pack(mb.weights).sum()) == pytest.approx(float(mb.weights.sum()))


def test_packing_is_used_where_the_attention_keeps_rows_apart():
    model = demo.build_model(0)
    learner = Learner(model, TrainerSection(micro_batch_tokens=64))
    assert learner.packing, "transformers' sdpa builds a block-diagonal mask from position ids"

    class IgnoresPositions(torch.nn.Module):
        """A model whose attention runs across packed rows (position ids dropped)."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None, **kw):
            return self.inner(input_ids=input_ids, **kw)

    assert not learner.packs(IgnoresPositions(model)), "would mix rows: bucketed and padded instead"


@pytest.mark.parametrize(
    ("loss", "agg", "packing"),
    [
        ("grpo", "token-mean", True),
        ("grpo", "token-mean", False),
        ("gspo", "auto", True),
        ("dro", "seq-mean", True),
    ],
)
def test_token_budget_gradient_is_the_padded_paths(loss, agg, packing):
    """One trainer step on a length mix: micro-batches of whole rows, padded to the longest,
    against token-budget micro-batches (packed or bucketed): same loss, entropy, gradient."""
    batch = _mixed_batch(2)
    results = []
    for tokens in (0, 48):
        model, ref = demo.build_model(0), demo.build_model(0)
        cfg = TrainerSection(
            lr=1e-3, loss=loss, loss_agg=agg, micro_batch_size=5, micro_batch_tokens=tokens, kl_coef=0.05
        )
        learner = Learner(model, cfg, ref_model=ref)
        if tokens and not packing:
            learner.packing = False
        assert learner.packing == bool(tokens and packing)
        metrics = learner.train_step(batch)
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((metrics, grads))
    (padded, g_padded), (budget, g_budget) = results
    assert torch.allclose(g_budget, g_padded, rtol=1e-4, atol=1e-6), float((g_budget - g_padded).abs().max())
    for key in ("loss", "policy_loss", "kl", "entropy", "tokens", "ratio_mean", "grad_norm"):
        assert budget[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
