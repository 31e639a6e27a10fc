"""The built-in judge: a reward that asks a model over HTTP (``producer.reward = "judge"``).

``[reward.judge]`` names it. ``kind = "chat"`` POSTs ``{url}/chat/completions`` (any
OpenAI-compatible server: vLLM, SGLang, a hosted API) with ``template`` filled in as the
user message (``{completion}``: the decoded completion; ``{prompt}``: the row's ``prompt``,
else its last user message; any other name: that field of the row, checked on every row
before work starts) and greedy decoding; the reward is the number in the reply (after
``####``, else in ``\\boxed{}``, else the last one). ``kind = "score"`` POSTs
``{"row": ..., "completion": ...}`` to ``url`` and reads ``{"score": x}`` (or a bare number).

A judge that cannot answer is an outage, not a zero reward: an unreachable server, a 429
or 5xx, or a timeout is retried ``retries`` times with backoff, then raises
:class:`RewardUnavailable` and the producer hands the row back without counting an attempt
(as for an engine outage). A judge that refuses the request (400, 413, 422) refuses this
row: the attempt counts. A judge that answers but not with a finite number rejects the
rollout with reason ``bad_reward`` and the reply quoted: the row is handed back and, after
``producer.max_row_attempts`` such answers, skipped with that reason. Never a silent 0.
"""

from __future__ import annotations

import logging
import math
import os
import string

import anyio
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

    def __init__(self, cfg: JudgeSection):
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
        self.__name__ = f"judge({cfg.url})"

    async def __call__(self, row: dict, text: str, completion=None) -> float:
        if self.cfg.kind == "chat":
            url = self.cfg.url.rstrip("/") + "/chat/completions"
            body = {
                "model": self.cfg.model,
                "messages": [{"role": "user", "content": self.prompt(row, text)}],
                "temperature": 0.0,
                "max_tokens": self.cfg.max_tokens,
            }
        else:
            url, body = self.cfg.url, {"row": row, "completion": text}
        reply = await self._post(url, body)
        return self._chat_score(reply) if self.cfg.kind == "chat" else self._endpoint_score(reply)

    def prompt(self, row: dict, text: str) -> str:
        """The template filled in for ``row`` and the completion ``text``."""
        return self.cfg.template.format_map({**row, "prompt": _prompt_of(row), "completion": text})

    async def _post(self, url: str, body: dict) -> bytes:
        timeout = httpx.Timeout(self.cfg.timeout, connect=min(10.0, self.cfg.timeout))
        last = ""
        async with httpx.AsyncClient(timeout=timeout, headers=self.headers) as http:
            for attempt in range(self.cfg.retries + 1):
                if attempt:
                    await anyio.sleep(min(0.25 * 2 ** (attempt - 1), 5.0))  # backoff between tries
                try:
                    r = await http.post(url, json=body)
                except httpx.TimeoutException:
                    last = f"no answer within {self.cfg.timeout:g}s"
                    continue
                except httpx.TransportError as e:
                    last = f"cannot be reached: {e!r}"
                    continue
                if r.status_code == 200:
                    return r.content
                last = f"answered {r.status_code}: {r.text[:QUOTE]!r}"
                if r.status_code in REFUSED_STATUS:
                    raise RewardUnavailable(f"judge {url} {last}", refused=True)
                if r.status_code not in RETRY_STATUS and r.status_code < 500:
                    break  # 401, 404, ...: a misconfigured judge; retrying will not help
        tries = attempt + 1
        raise RewardUnavailable(f"judge {url} {last} ({tries} {'try' if tries == 1 else 'tries'})")

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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(raw, 'is not {"score": <finite number>}')
        return float(value)


def _bad(reply: bytes | str, what: str) -> EpisodeRejected:
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    quoted = repr(text[:QUOTE]) + ("…" if len(text) > QUOTE else "")
    return EpisodeRejected("bad_reward", f"the judge's reply {what}: {quoted}")


def _prompt_of(row: dict) -> str:
    if "prompt" in row:
        return str(row["prompt"])
    users = [m.get("content", "") for m in row.get("messages", []) if m.get("role") == "user"]
    return str(users[-1]) if users else ""
