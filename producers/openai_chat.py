"""The OpenAI chat-completions API as the agent proxy (:mod:`producers.proxy`) speaks it.

A request is checked against the schema before anything else (the reason names the field):
an unknown key, ``n`` other than 1, ``stream``, empty messages or a ``max_tokens`` below 1
are a 400. Content parts are joined as text; tool-call arguments sent back as JSON strings
are parsed into objects before rendering, as templates that ``tojson`` them expect. With
``tools`` in a request, a completion's Hermes-style calls
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Qwen and many
open models) come back as ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

import msgspec

from producers import httpd
from streamer.rollout.contract import Completion

MODEL = "streamer-policy"  # the model name the proxy reports (any name is accepted)
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class Part(msgspec.Struct):
    type: str
    text: str = ""


class Message(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class Request(msgspec.Struct):
    messages: list[Message]
    model: str = MODEL
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False


class BadRequest(httpd.HTTPError):
    """A call answered with a 4xx/5xx and its reason."""


def parse_request(body: bytes) -> Request:
    """The request in ``body``, checked (module docstring)."""
    try:
        req = msgspec.json.decode(body, type=Request)
    except msgspec.DecodeError as e:
        raise BadRequest(400, f"bad request body: {e}") from None
    if req.n != 1:
        raise BadRequest(400, f"n must be 1 (each call samples one completion of the episode), not {req.n}")
    if req.stream:
        raise BadRequest(400, "stream is not supported")
    if not req.messages:
        raise BadRequest(400, "messages is empty")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is not None and limit < 1:
        raise BadRequest(400, f"max_tokens must be >= 1, not {limit}")
    return req


def template_message(m: Message) -> dict:
    """A message as chat templates take it: text parts joined, tool arguments as objects."""
    out = msgspec.to_builtins(m)
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise BadRequest(400, f"only text content is supported (a {m.role} message has other parts)")
        out["content"] = "".join(p.text for p in m.content)
    elif m.content is None:
        out["content"] = ""
    for call in out.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                raise BadRequest(400, f"tool call arguments are not JSON: {fn['arguments'][:80]!r}") from None
    return out


def tool_calls(text: str) -> tuple[str, list[dict]]:
    """Hermes-style ``<tool_call>{...}</tool_call>`` in ``text``: (content before them, calls)."""
    calls = []
    for i, m in enumerate(TOOL_CALL.finditer(text)):
        try:
            parsed = json.loads(m.group(1))
        except ValueError:
            continue  # not a call the agent could run: it stays in the content
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            continue
        arguments = parsed.get("arguments", {})
        calls.append(
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": parsed["name"], "arguments": json.dumps(arguments)},
            }
        )
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")], calls


def completion(req: Request, prompt: list[int], c: Completion, text: str) -> dict:
    """The ``chat.completion`` answering ``req`` with completion ``c`` (decoded: ``text``)."""
    content, calls = tool_calls(text) if req.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish = c.finish_reason
    if calls:
        message["tool_calls"], finish = calls, "tool_calls"
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(c.token_ids),
            "total_tokens": len(prompt) + len(c.token_ids),
        },
    }
