"""A verifiers harness that runs in the producer's process: a tool-less chat loop.

verifiers runs an agent's program (its *harness*) in a runtime and routes every model call
through its interception server. Its built-in harnesses (``null``, ``bash``, ...) are
programs that ``uv`` installs and runs, and they stream their calls. This one is a coroutine:
each segment is one model call with the conversation so far, not streamed, so it needs
neither ``uv`` nor a network and its calls pass the producer's proxy as they are.

verifiers finds a harness by a taskset module's ``__all__``: an environment that wants this
one exports it beside its taskset::

    from producers.envs.verifiers_harness import ChatHarness

    __all__ = ["MyTaskset", "ChatHarness"]
"""

from __future__ import annotations

import functools
import ssl

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult
from verifiers.v1.types import SystemMessage, UserMessage

TIMEOUT = 600.0  # seconds a call may take (the rollout's own timeout is the real bound)


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One model call per segment; a resumed exchange sends the whole conversation again."""

    APPENDS_SYSTEM_PROMPT = True  # the system prompt goes as a system message
    SUPPORTS_RESUME = True  # verifiers' default resume: the conversation as the prompt
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
        if system:
            messages.insert(0, SystemMessage(content=system))
        body = {"model": ctx.model, "messages": [message_to_wire(m) for m in messages]}
        async with httpx.AsyncClient(timeout=TIMEOUT, verify=_tls()) as client:
            reply = await client.post(
                endpoint.rstrip("/") + "/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
            )
        if reply.status_code != 200:  # verifiers records the failure on the trace
            return ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {reply.status_code}: {reply.text}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every call: a new client would load the CA store again (~30 ms)."""
    return ssl.create_default_context()


__all__ = ["ChatHarness"]
