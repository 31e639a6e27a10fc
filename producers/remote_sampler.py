"""A sampler backed by an OpenAI-compatible completions server (vLLM, SGLang) over httpx.

Request (``POST {base_url}/v1/completions``)::

    {"model": ..., "prompt": [token ids], "n": G, "temperature": ..., "top_p": ...,
     "max_tokens": ..., "logprobs": 1, "stop_token_ids": [...],
     "return_token_ids": true, "return_tokens_as_token_ids": true}

``prompt`` as a list of ints is a token-id prompt on both servers. Completion token ids
come back as ``choices[i].token_ids`` (vLLM >= 0.10.2 and SGLang with
``return_token_ids``); older vLLM only encodes them in ``choices[i].logprobs.tokens`` as
``"token_id:{id}"`` strings (``return_tokens_as_token_ids``), which is the fallback. The
log-prob of each sampled token is ``choices[i].logprobs.token_logprobs``. Both servers
keep the EOS token in ``token_ids`` when it ended the completion; it is cut after the
first stop id like the local sampler's.

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

import json
import logging
import random
import threading
import time
from pathlib import Path

import httpx

from producers.engines import Engine, Vllm
from producers.samplers import Completion, SamplerError, cut_at_stop
from streamer.errors import EpisodeRejected

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
MAX_REPLY_BYTES = 64 << 20


class _TooLarge(Exception):
    pass


_TOKEN_PREFIX = "token_id:"
_INT32_MAX = 2**31 - 1


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
    ):
        self.base_url = base_url.rstrip("/")
        self.model, self.stop_ids = model, list(stop_ids)
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.timeout = timeout
        self.engine = engine or Vllm()
        self.max_reply_bytes = max_reply_bytes
        self.adapters: list[str] = []  # loaded LoRA adapter names, oldest first
        self.max_parallel = concurrency  # engine calls a producer may have in flight at once
        self._slots = threading.BoundedSemaphore(concurrency)
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
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
        }
        # ``seed`` is not forwarded: with n > 1 a request seed is not portable across servers
        data = self._post("/v1/completions", body)
        return parse_completions(data, n=n, stop_ids=self.stop_ids)

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
        self.engine.reload(self._post, Path(directory))

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

    def _post(self, path: str, body: dict, *, as_json: bool = True):
        """POST with bounded retries; the JSON answer, or SamplerError."""
        attempt = 0
        while True:
            with self._slots:
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


def parse_completions(data: dict, *, n: int, stop_ids: list[int]) -> list[Completion]:
    """The ``n`` choices of a completions answer as Completions (ordered by ``index``).

    The answer is untrusted: a server that answers without the fields asked for (no
    choices, no log-probs, no token ids) is a :class:`SamplerError`; a choice whose values
    cannot mean what they say (an id that is not an int32, a log-prob that is not a number)
    drops the rollout (:class:`EpisodeRejected`); the ids' vocabulary and the log-probs'
    range are checked with the episode (:func:`producers.episodes.to_sample`).
    """
    try:
        choices = data["choices"]
        if not all(isinstance(c, dict) for c in choices):
            raise TypeError
        choices = sorted(choices, key=lambda c: c.get("index", 0))
    except (KeyError, TypeError, AttributeError):
        raise SamplerError(f"answer has no `choices`: {str(data)[:200]}") from None
    if len(choices) != n:
        raise SamplerError(f"asked for {n} completions, got {len(choices)}")
    return [_parse_choice(c, stop_ids) for c in choices]


def _parse_choice(choice: dict, stop_ids: list[int]) -> Completion:
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if logprobs is None:
        raise SamplerError("choice has no logprobs.token_logprobs (was `logprobs` ignored?)")
    ids = choice.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens") or []
        if not all(isinstance(t, str) and t.startswith(_TOKEN_PREFIX) for t in tokens):
            raise SamplerError(
                "choice has no token ids: the server needs `return_token_ids` (vLLM >= 0.10.2, "
                "SGLang) or `return_tokens_as_token_ids` (vLLM)"
            )
        ids = [_id_of(t[len(_TOKEN_PREFIX) :]) for t in tokens]
    if not isinstance(ids, list) or not isinstance(logprobs, list):
        raise EpisodeRejected("malformed", "the engine's token ids and log-probs must be lists")
    if len(ids) != len(logprobs) or any(p is None for p in logprobs):
        raise SamplerError(f"choice has {len(ids)} token ids but {len(logprobs)} log-probs")
    for i in ids:
        if type(i) is not int or not 0 <= i <= _INT32_MAX:
            raise EpisodeRejected("bad_token", f"the engine sent token id {i!r:.40}, not an int32 id")
    try:
        floats = [float(p) for p in logprobs if type(p) in (int, float)]
    except OverflowError:  # an int past float's range
        raise EpisodeRejected("bad_logprob", "the engine sent a log-prob past float's range") from None
    if len(floats) != len(logprobs):
        bad = next(p for p in logprobs if type(p) not in (int, float))
        raise EpisodeRejected("bad_logprob", f"the engine sent log-prob {bad!r:.40}, not a number")
    done = cut_at_stop(ids, floats, stop_ids)
    if done.finish_reason == "length" and choice.get("finish_reason") == "stop":
        # ended by a stop string or a stop token the server did not return: keep its verdict
        return Completion(done.token_ids, done.logprobs, "stop")
    return done


def _id_of(digits: str) -> int | str:
    """A ``token_id:{id}`` string's id (the text itself when it is not a plain number)."""
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 20 else digits
