"""The OpenAI chat-completions API as the agent proxy (:mod:`producers.proxy`) speaks it.

A request is checked against the schema before anything else (the reason names the field):
a field of the wrong type, ``n`` outside 1 to :data:`MAX_CHOICES`, empty messages or a
``max_tokens`` below 1 are a 400; keys the proxy does not use (``temperature``, ...) are
ignored. Content parts are joined as text; tool-call arguments sent back as JSON strings
are parsed into objects before rendering, as templates that ``tojson`` them expect. With
``tools`` in a request, a completion's Hermes-style calls
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Qwen and many
open models) come back as ``tool_calls``.

The answer is a ``chat.completion`` with one choice per completion sampled, or with
``stream: true`` the same as server-sent events (:func:`event_stream`): for each choice a
``chat.completion.chunk`` with the role, one with the content, one with the tool calls (if
any), one with the finish reason; then, with ``stream_options.include_usage``, a chunk with
no choices and the usage; then ``data: [DONE]``. The whole completion is sampled before the
first event is sent, so the content comes in one chunk.
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
MAX_CHOICES = 16  # the most choices (``n``) one call may ask for
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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Request(msgspec.Struct):
    messages: list[Message]
    model: str = MODEL
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class BadRequest(httpd.HTTPError):
    """A call answered with a 4xx/5xx and its reason."""


def parse_request(body: bytes) -> Request:
    """The request in ``body``, checked (module docstring)."""
    try:
        req = msgspec.json.decode(body, type=Request)
    except msgspec.DecodeError as e:
        raise BadRequest(400, f"bad request body: {e}") from None
    if not 1 <= req.n <= MAX_CHOICES:
        raise BadRequest(
            400, f"n must be between 1 and {MAX_CHOICES} (choices sampled by one call), not {req.n}"
        )
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


def completion(req: Request, prompt: list[int], choices: list[tuple[Completion, str]]) -> dict:
    """The ``chat.completion`` answering ``req`` with ``choices``: each completion sampled
    and its decoded text."""
    out = []
    for i, (c, text) in enumerate(choices):
        message, finish = _message(req, c, text)
        out.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
    return {**_head(req, "chat.completion"), "choices": out, "usage": _usage(prompt, choices)}


def chunks(req: Request, prompt: list[int], choices: list[tuple[Completion, str]]) -> list[dict]:
    """The ``chat.completion.chunk`` events of the same answer, as ``stream: true`` asks for
    (module docstring)."""
    head, out = _head(req, "chat.completion.chunk"), []
    usage = req.stream_options is not None and req.stream_options.include_usage

    def chunk(i: int, delta: dict, finish: str | None = None) -> dict:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice]} | ({"usage": None} if usage else {})

    for i, (c, text) in enumerate(choices):
        message, finish = _message(req, c, text)
        out.append(chunk(i, {"role": "assistant", "content": ""}))
        if message["content"]:
            out.append(chunk(i, {"content": message["content"]}))
        if "tool_calls" in message:
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            out.append(chunk(i, {"tool_calls": calls}))
        out.append(chunk(i, {}, finish))
    if usage:
        out.append({**head, "choices": [], "usage": _usage(prompt, choices)})
    return out


def event_stream(events: list[dict]) -> bytes:
    """``events`` as a ``text/event-stream`` body: one ``data:`` line each, then ``[DONE]``."""
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _message(req: Request, c: Completion, text: str) -> tuple[dict[str, Any], str]:
    """The assistant message of completion ``c`` (decoded: ``text``) and its finish reason."""
    content, calls = tool_calls(text) if req.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        return message, "tool_calls"
    return message, c.finish_reason


def _head(req: Request, kind: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": kind,
        "created": int(time.time()),
        "model": req.model,
    }


def _usage(prompt: list[int], choices: list[tuple[Completion, str]]) -> dict[str, int]:
    sampled = sum(len(c.token_ids) for c, _ in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": sampled, "total_tokens": len(prompt) + sampled}
