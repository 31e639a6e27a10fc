"""A rollout MetricsEvent whose step and version offset the publish script fills in.

A producer's metrics event for a group carries the group's rollout step (assigned by the
script that publishes the group) and its version offset (the policy version at that moment,
less the group's). To send the event in that same script, the producer encodes it once with
markers in those two places, and the script writes the real values over them, byte for
byte: the step as a msgpack uint32 (``0xce`` + 4 bytes), the offset as a float64 (``0xcb``
+ 8 bytes), the same widths as the markers. Readers decode an ordinary MetricsEvent.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from schemas import MetricsEvent, encode

STEP_MARK = 0xFFFFFFFF  # msgpack: 0xce ff ff ff ff
OFFSET_MARK = 1.5e300  # msgpack: 0xcb + its 8 bytes
OFFSET = "version_offset"

_STEP_AT = b"\xa4step\xce" + struct.pack(">I", STEP_MARK)
_OFFSET_AT = b"\xae" + OFFSET.encode() + b"\xcb" + struct.pack(">d", OFFSET_MARK)


class Stamped(NamedTuple):
    payload: bytes
    step_at: int  # 1-based position of the step's 5 bytes (Lua's string positions)
    offset_at: int  # 1-based position of the offset's 9 bytes


def stamped(*, values: dict[str, float], source: str) -> Stamped:
    """The rollout event of ``values`` (their ``version_offset`` is the script's to fill)."""
    event = MetricsEvent(
        axis="rollout", step=STEP_MARK, values={**values, OFFSET: OFFSET_MARK}, source=source
    )
    payload = encode(event)
    step, offset = payload.find(_STEP_AT), payload.find(_OFFSET_AT)
    if step < 0 or offset < 0 or payload.count(_STEP_AT) + payload.count(_OFFSET_AT) != 2:
        raise AssertionError("the metrics event's encoding has no unique place for its step")
    return Stamped(payload, step + len(_STEP_AT) - 4, offset + len(_OFFSET_AT) - 8)
