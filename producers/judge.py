"""The built-in judge: a reward that asks a model over HTTP (``producer.reward = "judge"``).

``[reward.judge]`` names it. ``kind = "chat"`` POSTs ``{url}/chat/completions`` (any
OpenAI-compatible server: vLLM, SGLang, a hosted API) with ``template`` filled in as the
user message (``{completion}``: the decoded completion; ``{prompt}``: the row's ``prompt``,
else its last user message; any other name: that field of the row, checked on every row
before work starts) and greedy decoding; the reward is the number in the reply (after
``####``, else in ``\\boxed{}``, else the last one). ``kind = "score"`` POSTs
``{"row": ..., "completion": ...}`` to ``url`` and reads ``{"score": x}`` (or a bare number).
``kind = "batch"`` asks once per group: it POSTs ``{"row": ..., "completions": [...]}`` (the
group's G completions) to ``url`` and reads ``{"scores": [x, ...]}`` (or a bare list), one
finite number per completion, in order (:meth:`Judge.score_group`, which
:func:`producers.rewards.score_all` calls when a reward has it). A reward model server that
scores a batch in one forward pass is asked once where the other kinds ask G times.

A judge that cannot answer is an outage, not a zero reward: an unreachable server, a 429
or 5xx, or a timeout is retried ``retries`` times with backoff, then raises
:class:`RewardUnavailable` and the producer hands the row back without counting an attempt
(as for an engine outage). A judge that refuses the request (400, 413, 422) refuses this
row: the attempt counts. A judge that answers but not with a finite number rejects the
rollout with reason ``bad_reward`` and the reply quoted: the row is handed back and, after
``producer.max_row_attempts`` such answers, skipped with that reason. Never a silent 0. A
reply is read as it streams in, never past ``max_reply_bytes`` (a larger ``Content-Length``
is refused from the headers): a larger one is such an answer too (``bad_reward``).

A judge keeps one pooled HTTP client per event loop (an aiohttp session: keep-alive
connections, at most ``reward.concurrency`` of them; ``https`` verified against certifi's
roots, or ``SSL_CERT_FILE``; ``HTTP(S)_PROXY`` and ``NO_PROXY`` honoured), made on the first
call in that loop: an async client belongs to the loop that opened its connections. Whoever
runs the loop closes it at the loop's end (:meth:`Judge.aclose`, through
:func:`producers.rewards.close`): the producer when it stops, the evaluator after each row's
rewards. A kept-alive connection the judge closed as a request arrived is asked once more on
a new one, outside ``retries``: a judge's score does not change when asked twice.

aiohttp and not httpx: httpx's pool looks at every pooled connection each time a request
starts or ends, ~1.5 ms of CPU a request with a group's 16 in flight, against aiohttp's
~0.2 ms (``bench/judge.py``).
"""

from __future__ import annotations

import logging
import math
import os
import string
import urllib.parse
import urllib.request

import aiohttp
import anyio
import anyio.lowlevel
import httpx
import msgspec

from producers.rewards import final_number
from streamer.config_rollout import JudgeSection
from streamer.errors import ConfigError, EpisodeRejected, RewardUnavailable

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
REFUSED_STATUS = {400, 413, 422}  # the request (this row) is wrong, not the judge
QUOTE = 200  # characters of a bad reply kept in the reason


class Judge:
    """An async reward ``(row, completion_text, completion) -> float`` served by a model."""

    def __init__(self, cfg: JudgeSection, *, concurrency: int = 32):
        if not cfg.url:
            raise ConfigError('`reward.judge.url` is empty (required when `producer.reward` = "judge")')
        self.cfg = cfg
        self.headers = {}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ConfigError(f"`reward.judge.api_key_env`: ${cfg.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        names = {f for _, f, _, _ in string.Formatter().parse(cfg.template) if f}
        if cfg.kind == "chat" and any(not n.isidentifier() for n in names):
            raise ConfigError(f"`reward.judge.template`: fields must be plain names, got {sorted(names)}")
        # checked against every row before work starts (producers.dataset.check_required)
        self.required_fields = tuple(sorted(names - {"completion", "prompt"})) if cfg.kind == "chat" else ()
        self.endpoint = cfg.url.rstrip("/") + "/chat/completions" if cfg.kind == "chat" else cfg.url
        if cfg.kind == "batch":  # one request a group: score_all asks it through score_group
            self.score_group = self._score_group
        parts = urllib.parse.urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
            raise ConfigError(
                f"`reward.judge.url` = {cfg.url!r}: give http(s)://host[:port]/path "
                "(a key goes in `reward.judge.api_key_env`)"
            )
        # verified as httpx verifies (certifi's roots; SSL_CERT_FILE / SSL_CERT_DIR honoured)
        self.ssl_context = httpx.create_ssl_context() if parts.scheme == "https" else None
        # HTTP(S)_PROXY and NO_PROXY read once: aiohttp's trust_env reads them (and ~/.netrc)
        # in a worker thread for every request, two thread hops a request
        bypass = urllib.request.proxy_bypass_environment(parts.netloc)
        self.proxy = None if bypass else urllib.request.getproxies_environment().get(parts.scheme)
        self.__name__ = f"judge({cfg.url})"
        self.concurrency = concurrency  # calls in flight at once (reward.concurrency): pooled connections
        self._http: aiohttp.ClientSession | None = None
        self._loop: anyio.lowlevel.EventLoopToken | None = None  # the loop ``_http`` belongs to

    async def __call__(self, row: dict, text: str, completion=None) -> float:
        if self.cfg.kind == "chat":
            body = {
                "model": self.cfg.model,
                "messages": [{"role": "user", "content": self.prompt(row, text)}],
                "temperature": 0.0,
                "max_tokens": self.cfg.max_tokens,
            }
        elif self.cfg.kind == "batch":
            return (await self._score_group(row, [text]))[0]
        else:
            body = {"row": row, "completion": text}
        reply = await self._post(msgspec.json.encode(body))
        return self._chat_score(reply) if self.cfg.kind == "chat" else self._endpoint_score(reply)

    async def _score_group(self, row: dict, texts: list[str], completions=None) -> list[float]:
        """``kind = "batch"``: the score of each of ``texts``, asked in one request."""
        reply = await self._post(msgspec.json.encode({"row": row, "completions": texts}))
        try:
            decoded = msgspec.json.decode(reply)
        except msgspec.DecodeError:
            raise _bad(reply, "is not JSON") from None
        values = decoded.get("scores") if isinstance(decoded, dict) else decoded
        if (
            not isinstance(values, list)
            or len(values) != len(texts)
            or not all(_finite_number(v) for v in values)
        ):
            raise _bad(reply, f'is not {{"scores": [<{len(texts)} finite numbers>]}}')
        return [float(v) for v in values]

    def prompt(self, row: dict, text: str) -> str:
        """The template filled in for ``row`` and the completion ``text``."""
        return self.cfg.template.format_map({**row, "prompt": _prompt_of(row), "completion": text})

    async def aclose(self) -> None:
        """Close this event loop's client, if it has one (the next call makes a new one)."""
        if self._http is not None and self._loop == anyio.lowlevel.current_token():
            http, self._http, self._loop = self._http, None, None
            await http.close()

    def _client(self) -> aiohttp.ClientSession:
        """The running loop's pooled client, made on its first call there."""
        loop = anyio.lowlevel.current_token()
        if self._http is None or self._loop != loop:
            # a client of another loop is left alone: its connections cannot be used, or
            # closed, from this one (its loop's owner closes it, see the module docstring)
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency, ssl=self.ssl_context or True),
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout, connect=min(10.0, self.cfg.timeout)),
                headers={**self.headers, "Content-Type": "application/json"},
            )
            self._loop = loop
        return self._http

    async def _post(self, body: bytes) -> bytes:
        http, last, url, asked_again = self._client(), "", self.endpoint, False
        attempt = 0
        while attempt <= self.cfg.retries:
            if attempt:
                await anyio.sleep(min(0.25 * 2 ** (attempt - 1), 5.0))  # backoff between tries
            attempt += 1
            try:
                async with http.post(url, data=body, proxy=self.proxy) as r:
                    status = r.status
                    limit = self.cfg.max_reply_bytes if status == 200 else QUOTE
                    content, whole = await _read(r, limit)
            except TimeoutError:
                last = f"no answer within {self.cfg.timeout:g}s"
                continue
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # a kept-alive connection closed as we asked on it: once more, on a new one
                if not asked_again and not isinstance(e, aiohttp.ClientConnectorError):
                    asked_again, attempt = True, attempt - 1
                last = f"cannot be reached: {e!r}"
                continue
            except aiohttp.ClientError as e:
                last = f"cannot be reached: {e!r}"
                continue
            if status == 200 and whole:
                return content
            if status == 200:
                too_large = f"the judge's reply is larger than reward.judge.max_reply_bytes = {limit}"
                if r.content_length is not None:
                    too_large += f" (Content-Length {r.content_length})"
                raise EpisodeRejected("bad_reward", too_large)
            last = f"answered {status}: {content.decode('utf-8', 'replace')!r}"
            if status in REFUSED_STATUS:
                raise RewardUnavailable(f"judge {url} {last}", refused=True)
            if status not in RETRY_STATUS and status < 500:
                break  # 401, 404, ...: a misconfigured judge; retrying will not help
        raise RewardUnavailable(f"judge {url} {last} ({attempt} {'try' if attempt == 1 else 'tries'})")

    def _chat_score(self, raw: bytes) -> float:
        try:
            content = msgspec.json.decode(raw)["choices"][0]["message"]["content"]
        except (msgspec.DecodeError, KeyError, IndexError, TypeError):
            raise _bad(raw, "is not a chat completion") from None
        value = final_number(content) if isinstance(content, str) else None
        if value is None or not math.isfinite(value):
            raise _bad(content, "has no number")
        return value

    def _endpoint_score(self, raw: bytes) -> float:
        try:
            reply = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise _bad(raw, "is not JSON") from None
        value = reply.get("score") if isinstance(reply, dict) else reply
        if not _finite_number(value):
            raise _bad(raw, 'is not {"score": <finite number>}')
        return float(value)


async def _read(r: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """(at most ``limit`` bytes of the body, whether that is all of it): never read further,
    nothing read when ``Content-Length`` is larger already."""
    if r.content_length is not None and r.content_length > limit:
        return b"", False
    body = bytearray()
    while len(body) <= limit and (chunk := await r.content.read(limit + 1 - len(body))):
        body += chunk
    return bytes(body[:limit]), len(body) <= limit


def _finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _bad(reply: bytes | str, what: str) -> EpisodeRejected:
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    quoted = repr(text[:QUOTE]) + ("…" if len(text) > QUOTE else "")
    return EpisodeRejected("bad_reward", f"the judge's reply {what}: {quoted}")


def _prompt_of(row: dict) -> str:
    if "prompt" in row:
        return str(row["prompt"])
    users = [m.get("content", "") for m in row.get("messages", []) if m.get("role") == "user"]
    return str(users[-1]) if users else ""
