"""The error hierarchy: one base, subclasses that also inherit the stdlib type they resemble."""


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
