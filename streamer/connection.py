"""Connecting to the server: URLs (with their passwords kept out of logs), the version
check, and riding out outages longer than the client's own retries."""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from streamer.config import BusSection
from streamer.errors import ConfigError, ServerError

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_SERVER = (6, 2)  # XAUTOCLAIM
# errors a retry can outlive: the server restarting, a cluster electing a new master for a slot,
# a cluster that is down (CLUSTERDOWN, MASTERDOWN: a node stopped answering, so a slot is not
# served) or whose topology the client cannot read now. ClusterDownError is also a
# ResponseError: a handler of ResponseError (a bad value, a wrong type) must let these through
# first (``except TRANSIENT: raise``), or a cluster's blip ends a role.
TRANSIENT = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # MasterDownError too
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    # a topology refresh that reached no node (not in every redis-py: the base class's
    # other uses are mistakes of the caller, so only this one)
    *[e for e in [getattr(redis.exceptions, "RedisClusterUnreachableError", None)] if e is not None],
)
# a cluster seed node: redis-py's cluster client discovers the rest (every key of a run is
# hash-tagged onto one slot, see streamer.keys)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def redact(url: str, text: str | None = None) -> str:
    """``text`` (default: the URL itself) with the URL's password replaced by ***, safe for logs.

    Not by URL parsing alone: a password with ``#``, ``/`` or ``?`` in it makes the parser cut
    the netloc short. The raw userinfo (between ``scheme://`` and the last ``@``) becomes
    ``user:***``, and every other form of the password (as split from it, as parsed, and
    percent-decoded) is removed wherever it occurs in ``text``.
    """
    text = url if text is None else text
    scheme, sep, rest = url.partition("://")
    userinfo = rest.rpartition("@")[0] if sep else ""
    user, colon, password = userinfo.partition(":")
    if not colon or not password:
        return text
    text = text.replace(userinfo, f"{user}:***")
    forms = {password, urllib.parse.unquote(password)}
    try:
        if parsed := urllib.parse.urlsplit(url).password:
            forms |= {parsed, urllib.parse.unquote(parsed)}
    except ValueError:  # a netloc the parser rejects (e.g. a bad port): the forms above remain
        pass
    for secret in sorted(forms, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _encoding_hint(url: str) -> str:
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if any(c in userinfo.partition(":")[2] for c in "#/?@[]"):
        return (
            "; a password with '#', '/', '?', '@', '[' or ']' must be percent-encoded "
            "(%23 %2F %3F %40 %5B %5D)"
        )
    return ""


def _unusable(url: str, e: ValueError) -> ConfigError:
    why = _encoding_hint(url) or f": {e}"  # the parser's message may quote a piece of the password
    return ConfigError(redact(url, f"redis URL {url!r} cannot be used{why}"))


def _cluster_error(url: str, e: RedisClusterException) -> ServerError:
    """What made a cluster client fail as it read the topology from the URL's seed node."""
    cause = e.__cause__
    if isinstance(cause, redis.exceptions.AuthenticationError):
        return ServerError(redact(url, f"{url}: authentication failed ({cause})"))
    if isinstance(cause, (*TRANSIENT, OSError)):  # no seed node answered
        return ServerError(redact(url, f"cannot reach the server at {url}: {cause}"))
    # e.g. "Cluster mode is not enabled on this node": the seed is a server of its own
    return ServerError(redact(url, f"{url}: {cause if isinstance(cause, RedisClusterException) else e}"))


def connect(
    url: str,
    *,
    socket_timeout: float = 10.0,
    name: str | None = None,
    check: bool = True,
    max_connections: int | None = None,
) -> redis.Redis:
    """A client for ``url`` (redis://, rediss://, unix://, with user:password if any).

    ``socket_timeout`` must exceed the longest BLOCK the caller uses. ``max_connections``:
    commands the client may have in flight at once, from as many threads (None: redis-py's
    default, 100 on recent versions; past it a command fails with "Too many connections").
    Transient errors are retried a bounded number of times with jittered exponential
    backoff, so a command to a stalled server raises within about 4 x ``socket_timeout``
    (no health-check PING: its own retries would nest inside each reconnect's, for over 30 s
    at 2 s); longer outages are the caller's to wait out (see :func:`retrying`). With
    ``check``, the server is pinged and its version checked, raising :class:`ServerError`
    with one clear line.
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:  # an unclosed '[', a bracketed host that is no IPv6 address
        raise _unusable(url, e) from None
    cluster = parts.scheme in CLUSTER_SCHEMES
    if parts.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        raise ConfigError(
            redact(
                url,
                f"redis URL {url!r}: scheme must be redis://, rediss://, unix:// "
                "or redis+cluster:// (rediss+cluster://)",
            )
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(redact(url, f"redis URL {url!r} has no host{_encoding_hint(url)}"))
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError(redact(url, f"redis URL {url!r} has no socket path"))
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ConfigError(redact(url, f"redis URL {url!r}: a cluster has only database 0"))
    try:
        client = (RedisCluster if cluster else redis.Redis).from_url(
            url.replace("+cluster://", "://", 1) if cluster else url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=min(5.0, socket_timeout),
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
            retry_on_error=list(TRANSIENT),
            client_name=name,
            protocol=2,  # RESP2 on every redis-py version and server (the shapes we parse)
            **({"max_connections": max_connections} if max_connections else {}),
        )
    except ValueError as e:
        raise _unusable(url, e) from None
    except RedisClusterException as e:  # a cluster client reads the topology as it is made
        raise _cluster_error(url, e) from None
    if check:
        check_server(client, url)
    return client


def check_server(client: redis.Redis, url: str) -> tuple[int, ...]:
    try:
        info = client.info("server")
    except redis.exceptions.AuthenticationError as e:
        raise ServerError(redact(url, f"{url}: authentication failed ({e})")) from None
    except redis.exceptions.ResponseError as e:
        raise ServerError(redact(url, f"{url}: {e}")) from None
    except TRANSIENT as e:
        raise ServerError(redact(url, f"cannot reach the server at {url}: {e}")) from None
    raw = str(info.get("valkey_version") or info.get("redis_version") or "0")
    version = tuple(int(p) for p in raw.split(".")[:3] if p.isdigit())
    # valkey reports redis_version 7.2.4 for compatibility; either way it must be >= 6.2
    if version[:2] < MIN_SERVER:
        raise ServerError(
            redact(url, f"server at {url} is version {raw}; streamer needs >= 6.2 (XAUTOCLAIM)")
        )
    return version


def replicated(client: redis.Redis, key: str, bus: BusSection, *, give_up_after: float | None = None) -> None:
    """Return once every write made to ``key``'s server (on a cluster: the master of its
    slot) before this call is held by ``bus.min_replicas`` replicas; a no-op for 0.

    Redis replication is asynchronous: a master that dies can take acknowledged writes with
    it when a replica is promoted. WAIT counts the replicas that hold the *calling
    connection's* last write, so rather than sharing a connection with the caller's write,
    an INCR of ``key`` and the WAIT go in one pipeline (one connection, pinned to the key's
    node on a cluster): that master took the INCR after every write it had taken, so a WAIT
    covering the INCR covers them. While the master answers but replicas lag, it waits on,
    with a warning every ``bus.replica_timeout`` s (availability is traded for durability, as asked),
    until ``give_up_after`` s (None: for ever) and then :class:`ServerError`. If the pinned
    node fails, whether the caller's write survived is unknown: the connection
    error is the caller's, to redo its work, never re-routed to a promoted replica here.
    """
    replicas, timeout = bus.min_replicas, bus.replica_timeout
    if replicas <= 0:
        return
    node = client.get_node_from_key(key).redis_connection if isinstance(client, RedisCluster) else client
    waited = 0.0
    while True:
        pipe = node.pipeline(transaction=False)
        pipe.incr(key)
        pipe.execute_command("WAIT", replicas, max(1, int(timeout * 1000)))
        acked = int(pipe.execute()[-1])
        if acked >= replicas:
            return
        waited += timeout
        if give_up_after is not None and waited >= give_up_after:
            raise ServerError(
                f"{acked} of {replicas} replica(s) (bus.min_replicas) held the last writes after {waited:.0f}s"
            )
        log.warning(
            "%d of %d replica(s) (bus.min_replicas) hold the last writes after %.0fs; waiting on",
            acked,
            replicas,
            waited,
        )


def retrying(fn: Callable[[], T], *, what: str, give_up_after: float | None = None) -> T:
    """Call ``fn`` until the server answers, backing off to 5 s, logging each failure.

    For outages longer than the client's own few retries (a server restart).
    """
    delay, start = 0.1, time.monotonic()
    while True:
        try:
            return fn()
        except TRANSIENT as e:
            if give_up_after is not None and time.monotonic() - start > give_up_after:
                raise ServerError(f"{what}: server unavailable for {give_up_after:.0f}s: {e}") from e
            log.warning("%s: server unavailable (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
