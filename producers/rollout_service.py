"""A remote rollout service as a rollout: ``producer.rollout = "http://host:port/path"``.

Every row is a call to the service: ``POST`` the JSON below, receive the row's episodes
token-native::

    request: {"row": {...}, "group_size": G, "seed": s, "max_seq_len": N,
              "sampling": {"temperature": t, "top_p": p, "max_new_tokens": m}}
    reply:   {"episodes": [{"segments": [{"tokens": [...]},                 # context
                                         {"tokens": [...], "logprobs": [...],
                                          "version": v}, ...],           # sampled
                            "reward": r, "finish_reason": "stop", "metrics": {...},
                            "forks": [[{"tokens": [...]}, ...], ...]}]}    # optional

A sampled segment names the policy version that sampled it (the service's engine
follows the run's weights; the proxy of :mod:`producers.proxy` is one way to); ``forks``
are the episode's earlier pieces (:class:`Episode`), segments like ``segments``. The reply
is untrusted: one that is not JSON or not of this shape, or larger than
``producer.max_reply_bytes`` (read as it streams in, never past the cap), drops the
rollout with reason ``malformed`` and a message naming the field; an HTTP error drops it
with reason ``error``; a reply not complete within ``producer.rollout_timeout`` (600 s
when that is 0) drops it with reason ``timeout``; all hand the row back and count towards
``max_row_attempts``. A service that cannot be reached, or answers 429/502/503/504, is an
outage, not the row's failure: the producer backs off as for a sampler outage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import msgspec

from streamer.errors import EpisodeRejected, SamplerError
from streamer.rollout.contract import Episode, FinishReason, Rollout, RolloutContext, Segment

if TYPE_CHECKING:
    import httpx

MAX_REPLY_BYTES = 64 << 20  # producer.max_reply_bytes' default
SERVICE_TIMEOUT = 600.0  # seconds for a whole service reply when producer.rollout_timeout is 0


class _WireSegment(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    logprobs: list[float] | None = None
    version: int | None = None
    mask: list[int] | None = None


class _WireEpisode(msgspec.Struct, forbid_unknown_fields=True):
    segments: list[_WireSegment]
    reward: float
    finish_reason: FinishReason = "stop"
    metrics: dict[str, float] = {}
    forks: list[list[_WireSegment]] = []


class _Reply(msgspec.Struct):
    episodes: list[_WireEpisode]


OUTAGE_STATUS = {429, 502, 503, 504}


def remote(url: str, *, timeout: float = 0.0, max_reply_bytes: int = MAX_REPLY_BYTES) -> Rollout:
    """A rollout that POSTs each row to the rollout service at ``url`` (module docstring):
    the whole reply within ``timeout`` seconds (0: :data:`SERVICE_TIMEOUT`) and
    ``max_reply_bytes`` bytes."""
    timeout = timeout or SERVICE_TIMEOUT

    async def rollout(row: dict, ctx: RolloutContext) -> list[Episode]:
        body = {
            "row": row,
            "group_size": ctx.group_size,
            "seed": ctx.seed,
            "max_seq_len": ctx.max_seq_len,
            "sampling": {
                "temperature": ctx.temperature,
                "top_p": ctx.top_p,
                "max_new_tokens": ctx.max_new_tokens,
            },
        }
        try:
            with anyio.fail_after(timeout):
                status, content = await _post(url, body, timeout=timeout, max_bytes=max_reply_bytes)
        except TimeoutError:  # a service that trickles its reply holds the row no longer than this
            raise TimeoutError(f"no complete answer within {timeout:.0f}s") from None
        if status in OUTAGE_STATUS:
            raise SamplerError(f"rollout service {url} answered {status}: {_text(content)}")
        if status != 200:
            raise RuntimeError(f"the service answered {status}: {_text(content)}")
        try:
            reply = msgspec.json.decode(content, type=_Reply)
        except msgspec.DecodeError as e:
            raise EpisodeRejected("malformed", f"sent a bad reply: {e}") from None
        return [_episode(e) for e in reply.episodes]

    rollout.__name__ = rollout.__qualname__ = f"remote({url})"
    return rollout


async def _post(url: str, body: dict, *, timeout: float, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of one POST: a 200's body up to ``max_bytes``, another's first 200 bytes."""
    import httpx  # here: ~0.07 s of imports that a run with no rollout service does without

    try:
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0)) as http,
            http.stream("POST", url, json=body) as r,
        ):
            return r.status_code, await _read(r, max_bytes if r.status_code == 200 else 200)
    except httpx.TimeoutException as e:
        if isinstance(e, httpx.ConnectTimeout):
            raise SamplerError(f"rollout service {url} cannot be reached: {e!r}") from None
        raise TimeoutError(f"no answer within {timeout:.0f}s") from None
    except httpx.TransportError as e:
        raise SamplerError(f"rollout service {url} cannot be reached: {e!r}") from None


async def read_capped(r: httpx.Response, limit: int, *, reason: str, too_large: str) -> bytes:
    """The body as it streams in: a 200 larger than ``limit`` is refused before it is all
    read (its Content-Length, else its bytes so far) as :class:`EpisodeRejected` with
    ``reason`` and ``too_large``; other bodies are cut at ``limit``."""
    declared = r.headers.get("Content-Length", "")
    if r.status_code == 200 and declared.isdigit() and int(declared) > limit:
        raise EpisodeRejected(reason, f"{too_large} (Content-Length {declared})")
    chunks, size = [], 0
    async for chunk in r.aiter_bytes():  # decoded: a compressed reply is capped as it expands
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if r.status_code == 200:
                raise EpisodeRejected(reason, too_large)
            break
    return b"".join(chunks)[:limit]


async def _read(r: httpx.Response, limit: int) -> bytes:
    too_large = f"the reply is larger than producer.max_reply_bytes = {limit}"
    return await read_capped(r, limit, reason="malformed", too_large=too_large)


def _text(content: bytes) -> str:
    return content[:200].decode(errors="replace")


def _episode(e: _WireEpisode) -> Episode:  # JSON numbers are finite: msgspec refuses 1e400
    forks = [_segments(piece) for piece in e.forks]
    return Episode(_segments(e.segments), e.reward, e.finish_reason, dict(e.metrics), forks=forks)


def _segments(wire: list[_WireSegment]) -> list[Segment]:
    return [Segment(s.tokens, s.logprobs, s.version, s.mask) for s in wire]
