"""Black-box agents: an OpenAI-compatible ``/v1/chat/completions`` served by the producer.

An agent written with any OpenAI client becomes a rollout with :func:`proxied`::

    @proxied
    async def agent(row: dict, endpoint: Endpoint) -> float:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        reply = await client.chat.completions.create(model=endpoint.model, messages=[...])
        ...
        return reward

Each of the G episodes of a row gets its own session on the process's proxy (127.0.0.1,
an ephemeral port, started on first use) with its own key. Every call is rendered with
the model's chat template (``tools`` included), sampled through the producer's sampler
(``ctx.sample``: the run's temperature, top-p and seed, stamped with the version that
sampled it; the request's sampling fields are ignored, since the trainer's importance
weights assume the run's), recorded, and answered as a ``chat.completion``, or with
``stream: true`` as its ``chat.completion.chunk`` events (:mod:`producers.openai_chat`).

The proxy assembles the trajectory from the token ids it saw, never from the agent's
text. A call whose prompt starts with every token of an earlier call's chain (prompt +
completion) *extends* that chain, and what it adds is context with weight 0. Otherwise
it starts a new chain: a *divergence* (counted, ``proxy_divergences``) when it shares the
chain's first prompt but breaks a later token (the agent re-sent the history in a form
that re-tokenizes differently: edited, summarised, or stripped, as thinking models' chat
templates strip earlier ``<think>`` blocks), else a new conversation. Every chain is
trained: the one the agent's last call extended is the episode's last piece, the others are
its forks (:attr:`Episode.forks`, counted as ``episode_forks``), each a sample of its own
with the episode's reward and advantage. A sampled token carries weight only in the chain
that sampled it; where a later chain's prompt repeats it, it is context.

A call with ``n`` > 1 (at most :data:`~producers.openai_chat.MAX_CHOICES`) samples its
``n`` choices in one engine call, and each choice is a chain: the first folds in as a
one-choice call does (it extends a chain, or starts one); each other starts a chain of its
own, the call's prompt as context and the choice as its sampled turn (a sibling, not a
divergence). The agent's next call extends whichever choice it went on with; the others
stay forks. Every choice is trained, with the episode's reward: the agent was shown all
``n``, and what it did next may depend on any of them, so each is part of the episode's
probability under the policy, and of its policy gradient, chosen or not. Training only the
kept choice would credit the policy with the agent's selection, as best-of-n does. Each
choice past the first is one more sample of the group: ``producer.max_forks`` bounds them
per episode, with the divergences.

Bad requests get a 4xx with a reason (OpenAI's error shape), never a crash: a body that
is not JSON or does not match the schema (the reason names the field), ``n`` outside 1 to
:data:`~producers.openai_chat.MAX_CHOICES`, messages the template cannot render, a prompt
with no room left under ``trainer.max_seq_len`` (when that is 0: the tokenizer's
``model_max_length``, else :data:`MAX_PROMPT_TOKENS`), found before anything is sampled
(and before rendering when the text has more characters than that many tokens hold). A
failed engine call is a 502 to the agent (a stream too: nothing is sent before the
sample), and the rollout then raises it to the producer (an engine outage, not the row's
failure).

The server is bounded (:mod:`producers.httpd`): the route and the episode's key are checked
before the body is read, the body's declared length before that (at most :data:`MAX_BODY`);
a connection that sends nothing for :data:`SOCKET_TIMEOUT` seconds is closed; at most
:data:`MAX_CONNECTIONS` are served at once (the next get a 503 at once). A client that
hangs up is one debug line.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import anyio.from_thread
import anyio.lowlevel

from producers import httpd
from producers.httpd import JsonHandler
from producers.openai_chat import (
    MODEL,
    BadRequest,
    chunks,
    completion,
    event_stream,
    parse_request,
    template_message,
)
from streamer.errors import EpisodeRejected, PrefixMismatch, SamplerError
from streamer.rollout.contract import Completion, Episode, Rollout, RolloutContext, episodes
from streamer.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20  # bytes
MAX_PROMPT_TOKENS = 32768  # a call's token limit if trainer.max_seq_len is 0 and the tokenizer has none
SOCKET_TIMEOUT = 30.0  # seconds a connection may send nothing (an idle keep-alive one too)
MAX_CONNECTIONS = 256  # connections served at once


@dataclass(frozen=True)
class Endpoint:
    """Where one episode's agent sends its calls."""

    base_url: str  # http://127.0.0.1:PORT/v1
    api_key: str  # this episode's key: calls with it are this episode's
    model: str = MODEL

    def env(self) -> dict[str, str]:
        """The variables OpenAI clients read, for an agent run as a subprocess."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}


Agent = Callable[[dict, Endpoint], Awaitable[float]]


def proxied(fn: Agent | None = None, *, max_trim_tokens: int = 0):
    """A rollout running agent ``fn(row, endpoint) -> reward`` once per episode (G at once).

    ``max_trim_tokens``: a call may drop that many trailing tokens of the last completion
    (a client that strips whitespace) and still extend its chain (:mod:`streamer.rollout.trajectory`).
    """

    def wrap(fn: Agent) -> Rollout:
        @functools.wraps(fn)
        async def episode(row: dict, ctx: RolloutContext, index: int) -> Episode:
            with server().session(ctx, max_trim_tokens=max_trim_tokens) as s:
                try:
                    reward = await fn(row, s.endpoint)
                finally:  # the engine's failure, not the agent's: the producer's outage path
                    if s.engine_error is not None:
                        raise s.engine_error
                return s.episode(reward)

        return episodes(episode)

    return wrap(fn) if fn is not None else wrap


# ---------------------------------------------------------------- sessions


class Session:
    """One episode's calls, folded into chains of token-exact turns."""

    def __init__(self, ctx: RolloutContext, endpoint: Endpoint, *, max_trim_tokens: int = 0):
        self.ctx, self.endpoint, self.max_trim_tokens = ctx, endpoint, max_trim_tokens
        self.token = anyio.lowlevel.current_token()  # the producer's event loop
        self.chains: list[Trajectory] = []
        self.last: Trajectory | None = None
        self.calls = self.divergences = 0
        self.engine_error: SamplerError | EpisodeRejected | None = (
            None  # a failed engine call (the agent saw a 502)
        )
        self.lock = threading.Lock()  # an agent may send calls in parallel

    def fold(self, prompt: list[int], choices: list[Completion]) -> str:
        """Record one call and its choices: "extended", "diverged" or "new", what its first
        choice did; each other choice starts a chain of its own (see the module docstring)."""
        first, *others = choices
        with self.lock:
            self.calls += 1
            how = self._fold(prompt, first)
            for choice in others:  # after the first: a sibling is no chain the first could extend
                self._chain(prompt, choice)
            return how

    def _fold(self, prompt: list[int], completion: Completion) -> str:
        shares_prompt = False
        for chain in sorted(self.chains, key=lambda c: len(c.tokens), reverse=True):
            try:
                chain.extend(prompt, completion)
            except PrefixMismatch as e:
                shares_prompt |= e.index >= len(chain.segments[0].tokens)
                continue
            self.last = chain
            return "extended"
        self.last = self._chain(prompt, completion)
        if shares_prompt:
            self.divergences += 1
            return "diverged"
        return "new"

    def _chain(self, prompt: list[int], completion: Completion) -> Trajectory:
        """A new chain: ``prompt`` as its context, ``completion`` its first sampled turn."""
        chain = Trajectory(prompt, max_trim_tokens=self.max_trim_tokens)
        chain.extend(prompt, completion)
        self.chains.append(chain)
        return chain

    def episode(self, reward: float) -> Episode:
        """The trained episode: the chain of the last call, the other chains as its forks
        (no call: a malformed, empty episode)."""
        with self.lock:
            extra = {"proxy_calls": float(self.calls), "proxy_divergences": float(self.divergences)}
            if self.last is None:
                return Episode([], reward, metrics=extra)
            extra["turns"] = float(sum(c.calls for c in self.chains))
            episode = self.last.episode(reward, **extra)
            episode.forks = [
                list(c.segments)
                for c in self.chains
                if c is not self.last and any(x.sampled for x in c.segments)
            ]
            return episode

    async def sample(self, prompt: list[int], max_new_tokens: int, n: int = 1) -> list[Completion]:
        """``n`` completions of ``prompt``, in one engine call (as many calls of one would all
        sample the episode's seed)."""
        out = await self.ctx.sample(prompt, n=n, max_new_tokens=max_new_tokens)
        if len(out) != n:
            raise EpisodeRejected(
                "malformed", f"the engine answered {len(out)} completions to a call for {n}"
            )
        return out


class ProxyServer:
    """The process's proxy: one HTTP server, a session per episode in flight."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        timeout: float = SOCKET_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.httpd = httpd.server(_handler(self), host, timeout=timeout, max_connections=max_connections)
        self.base_url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        httpd.start(self.httpd, "agent-proxy")

    @contextmanager
    def session(self, ctx: RolloutContext, *, max_trim_tokens: int = 0) -> Iterator[Session]:
        """A new episode's session, with its own key, for as long as the block runs."""
        key = "sk-episode-" + secrets.token_urlsafe(18)
        s = Session(ctx, Endpoint(self.base_url, key), max_trim_tokens=max_trim_tokens)
        with self._lock:
            self.sessions[key] = s
        try:
            yield s
        finally:
            with self._lock:
                del self.sessions[key]

    def lookup(self, authorization: str | None) -> Session:
        key = (authorization or "").removeprefix("Bearer ").strip()
        with self._lock:
            s = self.sessions.get(key)
        if s is None:
            raise BadRequest(401, "unknown API key (each episode has its own; this one is over or never was)")
        return s

    def complete(self, session: Session, body: bytes) -> tuple[bytes, str]:
        """One chat completion: render, sample in the producer's loop, record, answer (the
        body and its content type)."""
        req = parse_request(body)
        messages = [template_message(m) for m in req.messages]
        renderer, ctx = session.ctx.task.renderer, session.ctx
        max_len, limit_name = _max_len(ctx)
        chars = sum(len(m["content"]) for m in messages)
        if chars > max_len * _longest_token(renderer.tokenizer):  # no rendering could fit it
            raise BadRequest(400, f"the messages hold {chars} characters: too many for {limit_name}")
        try:
            prompt = renderer.render_messages(messages, tools=req.tools)
        except Exception as e:  # a template error names what it could not render
            raise BadRequest(400, f"cannot render the messages: {type(e).__name__}: {e}") from None
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = min(limit or ctx.max_new_tokens, ctx.max_new_tokens)
        room = max_len - len(prompt)
        if room < 1:
            raise BadRequest(400, f"the prompt is {len(prompt)} tokens: no room under {limit_name}")
        budget = min(budget, room)
        try:
            sampled = anyio.from_thread.run(session.sample, prompt, budget, req.n, token=session.token)
        except (SamplerError, EpisodeRejected) as e:  # an outage, or an answer that cannot be trained
            session.engine_error = e
            raise BadRequest(502, f"the engine call failed: {e}") from None
        except RuntimeError as e:  # the episode's event loop is gone
            raise BadRequest(503, f"the episode is over: {e}") from None
        how = session.fold(prompt, sampled)
        if how == "diverged":
            log.warning("proxy: a call re-tokenized an earlier turn; a new chain starts (counted)")
        choices = [(c, renderer.decode(c.token_ids)) for c in sampled]
        if req.stream:
            return event_stream(chunks(req, prompt, choices)), "text/event-stream"
        return json.dumps(completion(req, prompt, choices)).encode(), "application/json"


_server: ProxyServer | None = None
_server_lock = threading.Lock()


def server() -> ProxyServer:
    """The process's proxy, started on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ProxyServer()
            log.info("OpenAI-compatible proxy for agents on %s", _server.base_url)
        return _server


def _max_len(ctx: RolloutContext) -> tuple[int, str]:
    """The most tokens a call's prompt + completion may have, and what says so."""
    if ctx.max_seq_len:
        return ctx.max_seq_len, f"max_seq_len {ctx.max_seq_len}"
    named = getattr(ctx.task.renderer.tokenizer, "model_max_length", None)
    if isinstance(named, int) and 0 < named <= 1 << 24:  # unset, transformers says 1e30
        return named, f"the tokenizer's model_max_length {named}"
    return MAX_PROMPT_TOKENS, f"{MAX_PROMPT_TOKENS} tokens (trainer.max_seq_len is 0)"


@functools.cache
def _longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token: a text of n characters is at least
    n / this many tokens (byte-level and SentencePiece pieces spell what they stand for)."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _handler(proxy: ProxyServer):
    class Handler(JsonHandler):
        def do_POST(self):
            try:  # route and key first: nothing of a stranger's body is read
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self.close_connection = True  # the body is not read
                    raise BadRequest(404, f"no route {self.path} (the proxy serves /v1/chat/completions)")
                try:
                    session = proxy.lookup(self.headers.get("Authorization"))
                except BadRequest:
                    self.close_connection = True
                    raise
                body = self.read_body(MAX_BODY)
                self.send_body(200, *proxy.complete(session, body))
            except httpd.HTTPError as e:
                self._error(e.status, str(e))
            except httpd.GONE as e:  # the agent hung up or stalled: nothing to answer
                self.close_connection = True
                log.debug("proxy: client gone: %s", e)
            except Exception as e:  # a bug here must not take the producer down
                log.exception("proxy: request failed")
                self._error(500, f"{type(e).__name__}: {e}")

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            self._error(404, f"no route {self.path}")

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self.send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    return Handler
