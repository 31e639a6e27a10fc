"""The wire contract of streamer: events and their codec. No I/O, no torch."""

from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    SCHEMA_VERSION,
    DeadLetter,
    Event,
    MetricsEvent,
    Sample,
    TrajectoryGroup,
    WeightSync,
)

__all__ = [
    "SCHEMA_VERSION",
    "DeadLetter",
    "DecodeError",
    "Event",
    "MetricsEvent",
    "Sample",
    "TrajectoryGroup",
    "WeightSync",
    "decode",
    "encode",
]
