"""The version-stamp audit (consumers/audit.py): groups re-scored under the versions their
tokens are stamped with, against versions written to disk as the trainer writes them."""

from __future__ import annotations

import logging
import random
import threading

import pytest
from samples import group
from trainer_data import DIGITS, EOS, make_group, model_logprobs, prompt_ids, publish

from consumers import audit, trainer
from consumers.audit import Auditor
from consumers.learner import Learner
from schemas import MetricsEvent, Sample, Span
from streamer import demo, weights
from streamer.bus import entry_event
from streamer.config import RunConfig, replace
from streamer.errors import ConfigError


@pytest.fixture(scope="module")
def policies() -> dict[int, object]:
    """Versions 1 and 2: two different demo models (the trainer's initial weights and a later one)."""
    return {1: demo.build_model(1), 2: demo.build_model(2)}


@pytest.fixture
def root(tmp_path, policies):
    """A weights directory holding versions 1 and 2, written as the trainer writes them."""
    for version, model in policies.items():
        weights.write_version(model, tmp_path, version)
    return tmp_path


def auditor(root, *, fraction: float = 1.0, **kw) -> Auditor:
    return Auditor(fraction=fraction, weights_dir=root, build=lambda: demo.build_model(99), **kw)


def groups(policies, *, stamp: int, sampled_by: int, n: int = 3, seed: int = 0):
    """``n`` groups stamped version ``stamp`` whose log-probs are version ``sampled_by``'s."""
    rng = random.Random(seed)
    return [make_group(rng, version=stamp, model=policies[sampled_by]) for _ in range(n)]


def completion_tokens(gs) -> int:
    return sum(s.completion_len for g in gs for s in g.samples)


def test_tokens_sampled_by_their_stamped_version_audit_clean(root, policies):
    gs = groups(policies, stamp=1, sampled_by=1) + groups(policies, stamp=2, sampled_by=2, seed=1)
    values = auditor(root).audit(gs, step=1)
    assert values["audit_groups"] == 6 and values["audit_tokens"] == completion_tokens(gs)
    assert values["audit_logprob_gap_max"] < 1e-4
    assert values["audit_logprob_gap_mean"] < 1e-4
    assert values["audit_mismatched_token_share"] == 0 and values["audit_tokens_unauditable"] == 0


def test_a_stamp_naming_another_version_is_flagged_and_warned_about(root, policies, caplog):
    gs = groups(policies, stamp=1, sampled_by=2)  # a sampler that said v1 but had loaded v2
    with caplog.at_level(logging.WARNING, logger="consumers.audit"):
        values = auditor(root).audit(gs, step=7)
    assert values["audit_logprob_gap_mean"] > 0.02 and values["audit_mismatched_token_share"] > 0.5
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith("version stamps look wrong: ") and "(steps 7-7)" in message
    assert f"of {completion_tokens(gs)} audited tokens" in message and "producer.inflight_updates" in message


def test_a_sample_whose_spans_name_two_versions_is_scored_under_each(root, policies):
    prompt, completion = prompt_ids(3, 4), [*DIGITS[:4], EOS]
    first, second = (model_logprobs(policies[v], prompt, completion) for v in (1, 2))
    logprobs = first[:2] + second[2:]  # v2 was loaded after the second token
    fields = dict(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, finish_reason="stop")
    spans = [Span(0, 2, 1), Span(2, 5, 2)]
    told = group([Sample.build(**fields, reward=r, version=1, spans=spans) for r in (1.0, 0.0)])
    untold = group([Sample.build(**fields, reward=r, version=1) for r in (1.0, 0.0)])

    clean = auditor(root).audit([told], step=1)
    assert clean["audit_tokens"] == 10 and clean["audit_logprob_gap_max"] < 1e-4
    flagged = auditor(root).audit([untold], step=1)
    assert flagged["audit_tokens"] == 10 and flagged["audit_logprob_gap_max"] > 0.01
    assert flagged["audit_mismatched_token_share"] >= 0.4  # the second span's tokens, at least


def test_fraction_zero_audits_nothing(root, policies):
    def build():
        raise AssertionError("no audit model when the audit is off")

    off = Auditor(fraction=0.0, weights_dir=root, build=build)
    assert off.audit(groups(policies, stamp=1, sampled_by=2), step=1) == {}
    assert off.total.groups == off.total.tokens == 0


def test_a_version_gone_from_disk_is_unauditable_not_an_error(root, policies):
    assert weights.prune(root, keep=1) == [1]  # as the writer prunes past trainer.keep_versions
    old, new = groups(policies, stamp=1, sampled_by=1), groups(policies, stamp=2, sampled_by=2, seed=1)
    values = auditor(root).audit(old + new, step=1)
    assert values["audit_groups"] == 6
    assert values["audit_tokens_unauditable"] == completion_tokens(old)
    assert values["audit_tokens"] == completion_tokens(new) and values["audit_logprob_gap_max"] < 1e-4


def test_groups_are_chosen_by_id_alike_everywhere():
    ids = [f"{i}:{i % 7}" for i in range(2000)]
    picked = [i for i in ids if audit.chosen(i, 0.05)]
    assert 60 <= len(picked) <= 140  # ~5%
    assert set(picked) <= {i for i in ids if audit.chosen(i, 0.5)}  # a larger fraction adds to it
    assert all(audit.chosen(i, 1.0) for i in ids) and not any(audit.chosen(i, 0.0) for i in ids)


def test_samples_are_scored_padded_together_within_a_logits_budget(policies):
    rng = random.Random(3)
    samples = [s for g in (make_group(rng, rewards=(1.0, 0.0, 1.0)) for _ in range(3)) for s in g.samples]
    width = max(s.num_tokens for s in samples)
    cut = audit.chunks(samples, vocab=100, budget=2 * width * 100)
    assert [len(c) for c in cut] == [2, 2, 2, 2, 1] and [s for c in cut for s in c] == samples
    assert audit.chunks(samples[:1], vocab=100, budget=1) == [samples[:1]]  # one sample always fits
    model = policies[1]
    together = audit.completion_logprobs(model, samples)
    for s, logp in zip(samples, together):  # right padding changes nothing
        alone = model_logprobs(model, s.token_ids()[: s.prompt_len].tolist(), s.completion_ids().tolist())
        assert logp == pytest.approx(alone, abs=1e-5)


def test_consecutive_groups_of_one_version_load_it_once(root, policies, monkeypatch):
    loads = []
    load_into = weights.load_into
    monkeypatch.setattr(weights, "load_into", lambda model, d: (loads.append(d.name), load_into(model, d)))
    a = auditor(root)
    for step in (1, 2):
        a.audit(groups(policies, stamp=2, sampled_by=2, seed=step), step=step)
    a.audit(groups(policies, stamp=1, sampled_by=1), step=3)
    assert loads == ["v00000002", "v00000001"]


def test_the_warning_comes_at_most_once_per_window(root, policies, caplog):
    a = auditor(root, warn_every=10)
    bad = groups(policies, stamp=1, sampled_by=2, n=1)
    with caplog.at_level(logging.WARNING, logger="consumers.audit"):
        for step in range(1, 23):
            values = a.audit(bad if step % 2 else [], step=step)
    assert [r.getMessage().split("(steps ")[1].split(")")[0] for r in caplog.records] == [
        "1-1",
        "2-11",
        "12-21",
    ]
    assert values["audit_tokens"] == 0 and values["audit_logprob_gap_mean"] > 0.02  # the last audit's, kept


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_audit_fraction_outside_0_1_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="trainer.audit_fraction"):
        replace(RunConfig(), trainer={"audit_fraction": bad})


def test_the_trainer_audits_what_it_trains_and_reports_it(redis_url, keys, client, tmp_path):
    run = {"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)}
    trainer_keys = {"groups_per_step": 2, "lr": 1e-3, "steps": 1, "audit_fraction": 1.0}
    cfg = replace(RunConfig(), run=run, trainer=trainer_keys)
    client.set(keys.version, 5)  # the trainer publishes its initial weights as version 6
    initial = demo.build_model(cfg.run.seed)
    gs = [make_group(random.Random(i), version=6, model=initial) for i in range(2)]
    publish(client, keys.traj, gs)
    learner = Learner(demo.build_model(cfg.run.seed), cfg.trainer)
    assert trainer.Trainer(cfg, client, keys, learner, stop=threading.Event()).run() == 0
    [(_, fields)] = client.xrange(keys.metrics)
    values = entry_event(fields, MetricsEvent).values
    assert values["audit_groups"] == 2 and values["audit_tokens"] == completion_tokens(gs)
    assert values["audit_logprob_gap_max"] < 1e-4
