"""Every error Streamer raises on purpose, in one place: one base, subclasses that also inherit
the stdlib type they resemble. The CLI prints a :class:`StreamerError` as one line (exit 1; a
:class:`ConfigError` exits 2). ``DecodeError`` (a message that is not a valid event) lives with
the codec in ``schemas``, which does not depend on this package, and is re-exported here."""

from schemas.codec import DecodeError as DecodeError


class StreamerError(Exception):
    """Base of every error streamer raises on purpose."""


class ConfigError(StreamerError, ValueError):
    """A config file, URL or flag that cannot be used; the message names the key."""


class ServerError(StreamerError, ConnectionError):
    """The Redis-protocol server is unreachable, too old, or could not be started."""


class BackpressureTimeout(StreamerError, TimeoutError):
    """Publishing waited longer than allowed for consumers to catch up."""


class WeightsError(StreamerError, ValueError):
    """A weight-sync event whose weights cannot or must not be loaded."""


class DiskError(StreamerError, OSError):
    """A file streamer must write cannot be written (disk full, read-only, no permission)."""


class DataError(StreamerError, ValueError):
    """A value in the server that this version of Streamer cannot use."""


class PrefixMismatch(StreamerError, ValueError):
    """An engine call's prompt does not extend the trajectory; ``index`` is the first difference."""

    def __init__(self, index: int, expected: int | None, got: int | None, call: int):
        self.index, self.expected, self.got, self.call = index, expected, got, call
        super().__init__(
            f"engine call {call}: prompt diverges from the trajectory at token {index} "
            f"(trajectory has {expected}, prompt has {got}); render new messages with "
            "Trajectory.append_messages instead of re-rendering the history"
        )


class LeaseLost(StreamerError):
    """The row lease a slot was asked for has expired (its ticket went to someone else)."""


class LockedError(StreamerError):
    """Another process holds the data dir or run this process needs."""


class AdapterError(StreamerError, ValueError):
    """An adapter directory does not fit the model it is loaded into."""


class SamplerError(StreamerError, RuntimeError):
    """Sampling failed (server unreachable after retries, malformed answer, ...).

    ``refused``: the engine answered that this request is wrong (an HTTP 4xx such as a prompt
    longer than the model's context), so the row is at fault, not the engine: it counts as
    one of the row's failed attempts (``producer.max_row_attempts``); an outage does not.
    """

    def __init__(self, message: str, *, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class RewardUnavailable(SamplerError):
    """A reward that calls a model got no answer (unreachable, 5xx after retries, past its
    timeout): an outage like the engine's, so the row is handed back and no attempt counted."""


class CheckpointError(StreamerError, ValueError):
    """A checkpoint directory that is incomplete, damaged, or of another format."""


class DatasetError(ConfigError):
    """A dataset that cannot be used; the message names the file and line."""


class EpisodeRejected(StreamerError, ValueError):
    """An episode that must not be trained; ``reason`` is one of ``producers.episodes.REASONS``."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
