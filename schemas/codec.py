"""Encode and decode events. One Encoder and one Decoder per type, built once.

Decoding never raises anything but :class:`DecodeError`, whose ``reason`` says what was
wrong; consumers turn it into a dead letter instead of crashing.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from schemas.events import DeadLetter, Event, MetricsEvent, TrajectoryGroup, WeightSync

T = TypeVar("T")

MAX_PAYLOAD_BYTES = 256 * 1024 * 1024  # refuse absurd payloads before msgspec sees them

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder] = {
    t: msgspec.msgpack.Decoder(t) for t in (TrajectoryGroup, WeightSync, MetricsEvent, DeadLetter, Event)
}


class DecodeError(ValueError):
    """Bytes that are not a valid event of the expected type."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes, as_type: type[T] = Event) -> T:
    """Decode ``data`` as ``as_type`` (default: any event); raise DecodeError on bad bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload is {type(data).__name__}, not bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if not isinstance(data, bytes) and not memoryview(data).readonly:
        data = bytes(data)  # decoded events view their payload: never a buffer that can change
    try:
        return _decoders[as_type].decode(data)
    except msgspec.ValidationError as e:
        raise DecodeError(f"invalid {getattr(as_type, '__name__', 'event')}: {e}") from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"malformed msgpack: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
        raise DecodeError(f"undecodable payload: {e!r}") from None
