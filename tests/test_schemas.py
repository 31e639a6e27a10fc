"""The wire contract: round trips, zero-copy views, and validation as decode errors."""

from __future__ import annotations

import gc
import math

import msgspec
import numpy as np
import pytest
from samples import group, sample

from schemas import DeadLetter, DecodeError, MetricsEvent, TrajectoryGroup, WeightSync, decode, encode


def mutate(event, path: list, value) -> bytes:
    """Re-encode ``event`` with one field replaced, as a hostile producer would."""
    raw = msgspec.msgpack.decode(encode(event))
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgspec.msgpack.encode(raw)


def test_every_event_round_trips_through_its_decoder_and_the_union():
    events = [
        group(),
        WeightSync(version=1, step=1, uri="file:///w", sha256="f" * 64),
        MetricsEvent(axis="eval", step=3, values={"accuracy": 0.5}, source="eval"),
        DeadLetter(stream="s", entry_id="1-1", raw=b"\xc1", reason="bad"),
    ]
    for e in events:
        assert decode(encode(e), type(e)) == e
        assert decode(encode(e)) == e


def test_sample_views_are_little_endian_and_zero_copy():
    s = sample()
    assert s.tokens == np.array([5, 6, 7, 8, 9], "<i4").tobytes()
    assert s.token_ids().tolist() == [5, 6, 7, 8, 9]
    assert s.completion_ids().tolist() == [8, 9]
    np.testing.assert_allclose(s.sampler_logprobs(), [-0.1, -2.5], rtol=1e-6)
    assert s.loss_mask().tolist() == [1.0, 1.0]
    assert sample(mask=[0, 1]).loss_mask().tolist() == [0.0, 1.0]
    assert not s.token_ids().flags.writeable  # a view of the payload, not a copy


def test_decoding_does_not_copy_the_packed_arrays_nor_alias_a_mutable_buffer():
    payload = encode(group())
    decoded = decode(payload, TrajectoryGroup)
    wire = np.frombuffer(payload, np.uint8)
    assert np.shares_memory(decoded.samples[0].token_ids(), wire)  # zero-copy view
    assert np.shares_memory(decoded.samples[1].sampler_logprobs(), wire)
    assert not gc.is_tracked(decoded) and not gc.is_tracked(decoded.samples[0])  # no GC passes
    buf = bytearray(payload)
    from_buf = decode(buf, TrajectoryGroup)
    buf[:] = bytes(len(buf))  # the caller reuses its buffer: the event must not change
    assert from_buf == decoded


@pytest.mark.parametrize(
    "path, value, reason",
    [
        (["samples", 0, "reward"], math.nan, "reward is not finite"),
        (["samples", 0, "reward"], math.inf, "reward is not finite"),
        (["samples", 0, "prompt_len"], 4, "2 logprobs for 1 completion tokens"),
        (["samples", 0, "prompt_len"], 0, "prompt_len 0 outside"),
        (["samples", 0, "logprobs"], b"\x00" * 12, "3 logprobs for 2 completion tokens"),
        (["samples", 0, "tokens"], b"\x00" * 7, "not a multiple of 4"),
        (["samples", 0, "version"], -1, "version must be >= 0"),
        (["samples", 0, "mask"], b"\x01", "mask has 1 entries"),
        (["samples", 0, "finish_reason"], "exploded", "Invalid enum value"),
        (["policy_version"], -3, "policy_version must be >= 0"),
        (["policy_version"], 1, "policy_version 1 != oldest sample version 2"),
        (["samples"], [], "group has no samples"),
        (["schema"], 99, "unknown schema version 99"),
        (["row"], "seven", "Expected `int`"),
        (["group_id"], "", "group_id is empty"),
    ],
)
def test_invalid_groups_are_decode_errors_with_a_reason(path, value, reason):
    with pytest.raises(DecodeError) as err:
        decode(mutate(group(), path, value), TrajectoryGroup)
    assert reason in err.value.reason


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "malformed msgpack"),
        (b"\xc1", "malformed msgpack"),
        (encode(group())[:-5], "malformed msgpack"),
        (b"\xdb\xff\xff\xff\xff", "malformed msgpack"),  # str32 claiming 4 GiB
        (msgspec.msgpack.encode({"type": "nope"}), "Invalid value 'nope'"),
        ("not bytes", "not bytes"),
    ],
)
def test_garbage_is_a_decode_error_never_a_crash(payload, reason):
    with pytest.raises(DecodeError) as err:
        decode(payload, TrajectoryGroup)
    assert reason in err.value.reason


def test_weight_sync_and_metrics_validate():
    ws = WeightSync(version=1, step=1, uri="file:///w", sha256="f" * 64)
    with pytest.raises(DecodeError, match="sha256"):
        decode(mutate(ws, ["sha256"], "abc"), WeightSync)
    m = MetricsEvent(axis="train", step=1, values={"loss": 1.0}, source="t")
    with pytest.raises(DecodeError, match="Invalid enum value"):
        decode(mutate(m, ["axis"], "sideways"), MetricsEvent)
    with pytest.raises(DecodeError, match="Expected `float`"):
        decode(mutate(m, ["values", "loss"], "high"), MetricsEvent)
