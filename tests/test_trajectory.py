"""Trajectory assembly (the prefix invariant), checking a rollout's episodes, and the
schema-2 Sample with per-turn versions (a schema-1 event still decodes)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from samples import group

from producers.episodes import EpisodeRejected, to_sample
from producers.render import Renderer
from schemas import DecodeError, Sample, Span, TrajectoryGroup, decode, encode
from streamer import demo
from streamer.rollout.contract import Completion, Episode, Segment
from streamer.rollout.trajectory import PrefixMismatch, Trajectory


def _c(ids, version=0, lp=-0.5):
    return Completion(list(ids), [lp] * len(ids), "stop", version=version)


# ---------------------------------------------------------------- assembly


def test_calls_fold_into_one_trajectory_with_context_at_weight_zero():
    t = Trajectory([1, 2, 3])
    t.extend([1, 2, 3], _c([10, 11], version=0))
    t.append([20, 21])  # a tool result
    t.extend(t.next_prompt() + [22], _c([12], version=1))  # the prompt may add context itself
    ep = t.episode(1.0, tool_calls=1)
    assert ep.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    s = to_sample(ep, vocab_size=100)
    assert s.loss_mask().tolist() == [1, 1, 0, 0, 0, 1]
    assert s.token_versions().tolist() == [0, 0, -1, -1, -1, 1]
    assert s.version == 0 and s.spans == [Span(0, 2, 0), Span(5, 6, 1)]
    assert ep.metrics == {"tool_calls": 1.0, "turns": 2.0}


@pytest.mark.parametrize(
    ("prompt", "index"),
    [([1, 2, 9, 10, 11], 2), ([1, 2, 3, 10, 99], 4), ([1, 2], 2)],
)
def test_a_prompt_that_breaks_the_prefix_names_the_first_divergent_index(prompt, index):
    t = Trajectory([1, 2, 3])
    t.extend([1, 2, 3], _c([10, 11]))
    with pytest.raises(PrefixMismatch) as e:
        t.extend(prompt, _c([5]))
    assert e.value.index == index and e.value.call == 2 and f"token {index}" in str(e.value)


def test_max_trim_tokens_tolerates_a_bounded_trim_of_the_last_turn():
    t = Trajectory([1, 2], max_trim_tokens=1)
    t.extend([1, 2], _c([10, 11]))
    t.extend([1, 2, 10, 30], _c([12]))  # the template dropped the trailing 11 and added 30
    assert t.tokens == [1, 2, 10, 30, 12] and t.trimmed == 1
    s = to_sample(t.episode(0.0), vocab_size=100)
    assert s.loss_mask().tolist() == [1, 0, 1]
    t2 = Trajectory([1, 2], max_trim_tokens=1)
    t2.extend([1, 2], _c([10, 11, 12]))
    with pytest.raises(PrefixMismatch):  # two tokens trimmed: more than allowed
        t2.extend([1, 2, 10, 30], _c([12]))


def test_new_messages_are_appended_as_rendered_tokens_not_a_rerender():
    tok = demo.tokenizer()
    r = Renderer(tok)
    row = demo.rows()[3]
    t = Trajectory(r.render(row))
    answer = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    t.extend(t.next_prompt(), _c(answer))
    prompt = t.append_messages(r, [{"role": "user", "content": "1+1="}])
    full = tok.apply_chat_template(
        [*row["messages"], {"role": "assistant", "content": "7"}, {"role": "user", "content": "1+1="}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert prompt == list(full)  # this template re-renders consistently, so both agree


# ---------------------------------------------------------------- checking episodes


def _ep(*segments, reward=1.0):
    return Episode(list(segments), reward)


@pytest.mark.parametrize(
    ("episode", "reason", "words"),
    [
        (_ep(Segment([1]), Segment([2, 3], [-0.1], 0)), "malformed", "2 tokens but 1 log-probs"),
        (_ep(Segment([1]), Segment([2], [-0.1], 0), Segment([3], mask=[1])), "malformed", "did not sample"),
        (_ep(Segment([1]), Segment([2], [-0.1], None)), "malformed", "without a policy version"),
        (_ep(Segment([1]), Segment([500], [-0.1], 0)), "bad_token", "token id 500"),
        (_ep(Segment([-1]), Segment([5], [-0.1], 0)), "bad_token", "token id -1"),
        (_ep(Segment([1]), Segment([5], [math.nan], 0)), "bad_logprob", "NaN"),
        (_ep(Segment([1]), Segment([5], [-0.1], 0), reward=math.inf), "bad_reward", "inf"),
        (_ep(Segment([1] * 8), Segment([5] * 3, [-0.1] * 3, 0)), "too_long", "11 tokens > max_seq_len 10"),
        (_ep(Segment([1]), Segment([4])), "malformed", "no sampled segment"),
        (_ep(Segment([1], [-0.1], 0), Segment([4], [-0.1], 0)), "malformed", "prompt segment"),
        ("not an episode", "malformed", "not an Episode"),
    ],
)
def test_malformed_episodes_are_rejected_with_a_reason(episode, reason, words):
    with pytest.raises(EpisodeRejected) as e:
        to_sample(episode, vocab_size=100, max_seq_len=10)
    assert e.value.reason == reason and words in str(e.value)


# ---------------------------------------------------------------- the wire


def test_per_turn_versions_survive_the_wire_and_the_group_takes_the_oldest():
    s = Sample.build(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5, 6],
        logprobs=[-1, -1, 0, -1],
        reward=1.0,
        finish_reason="stop",
        version=3,
        mask=[1, 1, 0, 1],
        spans=[Span(0, 2, 3), Span(3, 4, 4)],
    )
    single = Sample.build(
        prompt_ids=[1], completion_ids=[3], logprobs=[-1], reward=0.0, finish_reason="stop", version=4
    )
    g = decode(encode(group([s, single])), TrajectoryGroup)
    assert g.policy_version == 3 and g.samples[0].token_versions().tolist() == [3, 3, -1, 4]
    assert g.samples[1].token_versions().tolist() == [4] and g.samples[1].spans is None


@pytest.mark.parametrize(
    ("spans", "mask", "words"),
    [
        ([Span(0, 2, 3), Span(1, 3, 3)], None, "overlaps"),
        ([Span(0, 5, 3)], None, "outside"),
        ([Span(0, 2, 4)], None, "oldest span version 4"),
        ([Span(0, 2, 3)], [1, 1, 1, 0], "outside every sampled span"),
        ([], None, "spans is empty"),
    ],
)
def test_inconsistent_spans_do_not_decode(spans, mask, words):
    with pytest.raises(ValueError, match=words):
        Sample.build(
            prompt_ids=[1],
            completion_ids=[3, 4, 5, 6],
            logprobs=[-1] * 4,
            reward=1.0,
            finish_reason="stop",
            version=3,
            mask=mask,
            spans=spans,
        )


def test_a_schema_1_event_still_decodes_and_an_unknown_version_is_named():
    s = Sample.build(
        prompt_ids=[1], completion_ids=[3, 4], logprobs=[-1, -1], reward=1.0, finish_reason="stop", version=2
    )
    as_dict = msgspec.msgpack.decode(encode(group([s])))  # what a schema-1 producer wrote:
    as_dict["schema"] = 1  # the same fields, no spans (nor episode)
    for sample in as_dict["samples"]:
        sample.pop("spans", None)
        sample.pop("episode", None)
    raw = msgspec.msgpack.encode(as_dict)
    g = decode(raw, TrajectoryGroup)
    assert g.schema == 1 and g.samples[0].spans is None and g.samples[0].token_versions().tolist() == [2, 2]
    assert g.samples[0].episode is None and g.episode_index().tolist() == [0]
    future = msgspec.msgpack.decode(raw)
    future["schema"] = 4
    with pytest.raises(DecodeError, match=r"unknown schema version 4 \(this build reads 1, 2, 3\)"):
        decode(msgspec.msgpack.encode(future), TrajectoryGroup)
    assert np.array_equal(g.samples[0].loss_mask(), [1, 1])
