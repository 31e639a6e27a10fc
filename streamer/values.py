"""Values read back from Redis, parsed defensively: a bad one is an error naming its key.

A counter an operator set by hand, a key of the wrong type, a field a bug wrote: each
becomes one :class:`DataError` line that says which key holds what, instead of a
traceback from ``int()`` deep inside a role. A key that changes type while a role runs
gets a WRONGTYPE reply that names no key: :func:`wrong_type` finds and names it.
"""

from __future__ import annotations

import redis

from streamer.connection import TRANSIENT
from streamer.errors import DataError


def parse_int(raw, key: str, *, default: int | None = None, minimum: int | None = None) -> int:
    """``raw`` (bytes, str, int or None) as an int; DataError naming ``key`` otherwise."""
    if raw is None:
        if default is None:
            raise DataError(f"{key} is missing")
        return default
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    try:
        value = int(text)
    except ValueError:
        raise DataError(
            f"{key} holds {text[:40]!r}, not an integer; fix or delete the key (`DEL {key}`)"
        ) from None
    if minimum is not None and value < minimum:
        raise DataError(f"{key} holds {value}, below {minimum}; fix or delete the key (`DEL {key}`)")
    return value


def check_types(client, types: dict[str, str]) -> None:
    """DataError naming the first key (of ``types``: key -> Redis type) that exists with
    another type, e.g. a string written where the run keeps a stream."""
    pipe = client.pipeline(transaction=False)
    for key in types:
        pipe.type(key)
    for (key, want), got in zip(types.items(), pipe.execute()):
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got not in ("none", want):
            raise DataError(
                f"{key} is a {got}, where this run keeps a {want}; fix or delete the key (`DEL {key}`)"
            )


def wrong_type(client, types: dict[str, str], error: BaseException) -> DataError | None:
    """For a command the server refused (WRONGTYPE, or a blocked read whose stream was
    replaced), the DataError :func:`check_types` raises for the first key of ``types`` that
    holds another type now; None for any other error, or when every key has its type."""
    if not isinstance(error, redis.exceptions.ResponseError) or isinstance(error, TRANSIENT):
        return None
    try:
        check_types(client, types)
    except DataError as named:
        return named
    except redis.exceptions.RedisError:  # the server cannot say now: the refusal stands as it is
        pass
    return None
