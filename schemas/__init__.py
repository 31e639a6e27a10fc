"""The wire contract of streamer: events and their codec. No I/O, no torch."""

from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    DeadLetter,
    Event,
    MetricsEvent,
    Sample,
    Span,
    TrajectoryGroup,
    WeightSync,
)

__all__ = [
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "DeadLetter",
    "DecodeError",
    "Event",
    "MetricsEvent",
    "Sample",
    "Span",
    "TrajectoryGroup",
    "WeightSync",
    "decode",
    "encode",
]
