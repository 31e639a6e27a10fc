"""A sampler backed by an OpenAI-compatible completions server (vLLM, SGLang) over httpx.

Request (``POST {base_url}/v1/completions``)::

    {"model": ..., "prompt": [token ids], "n": G, "temperature": ..., "top_p": ...,
     "max_tokens": ..., "logprobs": 1, "stop_token_ids": [...],
     "return_token_ids": true, "return_tokens_as_token_ids": true}

``prompt`` as a list of ints is a token-id prompt on both servers; the answer is checked by
:mod:`producers.completions`.

Attached to the server's :class:`~producers.reload.ServerVersions` (the weight follower
does it), every request is a flight that knows the version that sampled each token: whole
with ``producer.inflight_updates = "drain"``, streamed (:mod:`producers.streaming`) with
``keep`` and ``abort``, whose requests may span an update.

Timeouts per request, bounded retries with exponential backoff and jitter on transport
errors, 429 and 5xx; other 4xx fail at once. At most ``concurrency`` requests are in
flight from one sampler. New weights reach the server through its engine profile
(:mod:`producers.engines`: vLLM's ``/collective_rpc`` reload, SGLang's
``/update_weights_from_disk``); the server must see the same filesystem path. A LoRA
adapter version (streamer/lora.py) is instead loaded as a named adapter
(``{"lora_name": "streamer-v…", "lora_path": directory}``), and later requests name that
adapter as their ``model``; adapters two versions old are unloaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from pathlib import Path

import httpx

from producers import streaming
from producers.completions import parse_completions
from producers.engines import Engine, Vllm
from producers.samplers import Completion, SamplerError

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
MAX_REPLY_BYTES = 64 << 20


class _TooLarge(Exception):
    pass


class RemoteSampler:
    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        stop_ids: list[int],
        timeout: float = 120.0,
        retries: int = 3,
        concurrency: int = 8,
        engine: Engine | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        extra_body: dict | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model, self.stop_ids = model, list(stop_ids)
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.timeout = timeout
        self.engine = engine or Vllm()
        self.max_reply_bytes = max_reply_bytes
        self.adapters: list[str] = []  # loaded LoRA adapter names, oldest first
        self.extra_body = dict(extra_body or {})  # engine-specific request fields (e.g. vLLM's min_tokens)
        self.server = None  # producers.reload.ServerVersions, once attached: per-token versions
        self.can_pause = True  # False once check_updates found no pause on the server
        self.max_parallel = concurrency  # engine calls a producer may have in flight at once
        self._slots = threading.BoundedSemaphore(concurrency)
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
            # + the control calls (reload, pause, resume), which must not wait for a request slot
            limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2),
        )

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        body = {
            "model": self.model,
            "prompt": [int(i) for i in prompt_ids],
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_new_tokens,
            "logprobs": 1,
            "stop_token_ids": self.stop_ids,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.extra_body,
        }
        # ``seed`` is not forwarded: with n > 1 a request seed is not portable across servers
        if self.server is None:  # nobody tracks the server's versions: the caller stamps them
            data = self._post("/v1/completions", body)
            return parse_completions(data, n=n, stop_ids=self.stop_ids)
        if self.server.mode == "drain":  # no request spans an update: its flight's version is exact
            with self._slots, self.server.flight(streamed=False) as flight:
                data = self._post("/v1/completions", body, slot=False)
            done = parse_completions(data, n=n, stop_ids=self.stop_ids)
            return [Completion(c.token_ids, c.logprobs, c.finish_reason, flight.version) for c in done]
        return streaming.sample(self, body)

    def attach(self, server) -> None:
        """Track this server's versions per token with ``server``
        (:class:`producers.reload.ServerVersions`): completions come back stamped."""
        self.server = server

    def engine_missing(self) -> str:
        """What the server lacks for ``producer.inflight_updates`` ("" = nothing)."""

        def get(path: str) -> int:
            try:
                return self._http.get(path).status_code
            except httpx.TransportError:
                return 0

        return self.engine.missing(get)

    def check_updates(self) -> None:
        """At start: say in one line what the server lacks for ``producer.inflight_updates``
        and which modes remain; SamplerError (refused) when the configured mode needs it."""
        if not self.follows_versions or not (missing := self.engine_missing()):
            return
        self.can_pause = False
        mode = self.server.mode if self.server is not None else "drain"
        line = (
            f"{self.base_url} ({self.engine.name}) has no {missing}: producer.inflight_updates 'keep' "
            "cannot work; 'drain' and 'abort' remain (their clients drain or cut requests, and the "
            "reload runs unpaused)"
        )
        if mode == "keep":
            raise SamplerError(line, refused=True)
        log.warning("%s", line)

    # the in-flight protocol's engine calls (producers.reload.ServerVersions._update)
    def pause(self, mode: str) -> None:
        if self.can_pause:
            self.engine.pause(self._control, mode)

    def reset(self, *, running: bool) -> None:
        self.engine.reset(self._control, running=running)

    def resume(self) -> None:
        if self.can_pause:
            self.engine.resume(self._control)

    @property
    def follows_versions(self) -> bool:
        return self.engine.follows_versions

    def probe(self, prompt_ids: list[int]) -> None:
        """One short completion, no retries: returns once the engine samples. SamplerError
        with ``refused`` when it answers with an error (it refuses the model or the request),
        without when it cannot be reached (not up yet, or down)."""
        body = {"model": self.model, "prompt": [int(i) for i in prompt_ids], "max_tokens": 1, "logprobs": 1}
        body["return_token_ids"] = True
        try:
            resp = self._http.post("/v1/completions", json=body)
        except httpx.TransportError as e:
            raise SamplerError(f"{self.base_url}: {type(e).__name__}: {e}") from None
        if resp.status_code in RETRY_STATUS - {500}:  # busy or still starting: not an answer yet
            raise SamplerError(f"{self.base_url}: HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code >= 400:  # 500 included: vLLM's answer to a model its backend refuses
            raise SamplerError(
                f"{self.base_url} ({self.engine.name}) refused a first completion: HTTP {resp.status_code}: "
                f"{resp.text[:300]}",
                refused=True,
            )

    def load_weights(self, directory: Path) -> None:
        from streamer import lora

        if lora.is_adapter(directory):
            return self._load_adapter(Path(directory))
        self.pause("drain")  # alone: nobody tracks requests in flight, the engine drains them
        try:
            self.reload(Path(directory))
            self.reset(running=False)
        finally:
            self.resume()

    def reload(self, directory: Path) -> None:
        """Only the full weights in ``directory`` into the engine: the in-flight protocol
        around it is :class:`producers.reload.ServerVersions`'."""
        self.engine.reload(self._control, Path(directory))

    def adopt(self, directory: Path) -> None:
        """Another producer loaded ``directory`` into this shared server: sample with it too.

        Full weights replace the server's model and need nothing here; a LoRA adapter is
        named in every request, so the name must follow.
        """
        from streamer import lora

        if lora.is_adapter(directory):
            self.model = f"streamer-{Path(directory).name}"

    def reload_deadline(self) -> float:
        """Seconds a reload may take at most, retries and backoff included (+ a margin)."""
        return self.timeout * (self.retries + 1) + self.max_backoff * self.retries + 10.0

    def _load_adapter(self, directory: Path) -> None:
        name = f"streamer-{directory.name}"
        if not self.engine.lora_load:
            raise SamplerError(f"engine {self.engine.name!r} cannot load LoRA adapters", refused=True)
        self._post(self.engine.lora_load, {"lora_name": name, "lora_path": str(directory)}, as_json=False)
        self.model = name  # requests in flight keep the previous adapter, which stays loaded
        self.adapters.append(name)
        while len(self.adapters) > 2 and self.engine.lora_unload:
            old = self.adapters.pop(0)
            try:
                self._post(self.engine.lora_unload, {"lora_name": old}, as_json=False)
            except SamplerError as e:  # a leftover adapter costs server memory, not correctness
                log.warning("could not unload LoRA adapter %s: %s", old, e)

    def close(self) -> None:
        self._http.close()

    def _read(self, path: str, body: dict) -> tuple[int, bytes]:
        """(status, body) of one POST, read as it streams in: at most ``max_reply_bytes``, all
        of it within ``timeout`` seconds (an answer trickled in forever is a timeout)."""
        deadline = time.monotonic() + self.timeout
        with self._http.stream("POST", path, json=body) as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_reply_bytes:
                raise _TooLarge(
                    f"answer of {declared} bytes is over {self.max_reply_bytes} (producer.max_reply_bytes)"
                )
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > self.max_reply_bytes:
                    raise _TooLarge(f"answer is over {self.max_reply_bytes} bytes (producer.max_reply_bytes)")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"answer not complete after {self.timeout:.0f}s")
                chunks.append(chunk)
            return resp.status_code, b"".join(chunks)

    def _control(self, path: str, body: dict, *, as_json: bool = True):
        """A control call (reload, pause, reset, resume): never waits behind the requests it
        controls for one of their slots."""
        return self._post(path, body, as_json=as_json, slot=False)

    def _post(self, path: str, body: dict, *, as_json: bool = True, slot: bool = True):
        """POST with bounded retries; the JSON answer, or SamplerError. ``slot``: take one of
        the ``concurrency`` request slots (False: the caller holds one)."""
        attempt = 0
        while True:
            with self._slots if slot else contextlib.nullcontext():
                try:
                    status, content = self._read(path, body)
                    error = (
                        None if status < 400 else f"HTTP {status}: {content[:200].decode(errors='replace')}"
                    )
                    retryable = status in RETRY_STATUS
                    refused = status < 500 and not retryable  # this request is wrong
                except httpx.TransportError as e:
                    error, retryable, refused = f"{type(e).__name__}: {e}", True, False
                except _TooLarge as e:  # the engine's answer to this request: asking again gives the same
                    error, retryable, refused = str(e), False, True
            if error is None:
                if not as_json:  # vLLM answers its LoRA endpoints in plain text
                    return content.decode(errors="replace")
                try:
                    return json.loads(content)
                except ValueError:
                    raise SamplerError(f"{self.base_url}{path}: answer is not JSON") from None
            if not retryable or attempt >= self.retries:
                raise SamplerError(
                    f"{self.base_url}{path}: {error} (after {attempt + 1} attempts)", refused=refused
                )
            delay = min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + random.random() / 2)
            log.warning(
                "%s%s: %s; retry %d/%d in %.2fs", self.base_url, path, error, attempt + 1, self.retries, delay
            )
            time.sleep(delay)
            attempt += 1
