"""Streamed completions whose requests may span an update of the server's weights.

With ``producer.inflight_updates`` ``keep`` or ``abort`` a request is streamed
(``"stream": true``), so its tokens arrive as they are sampled and each is stamped, as it
arrives, with its flight's version (:class:`producers.reload.Flight`):

- ``keep``: the server pauses with the request in place; once its stream has gone quiet the
  flight's version moves to the update's, so the tokens sampled after the resume carry it.
- ``abort``: the flight is cut; the stream is closed (the engine aborts a request whose
  client left) and the tokens so far, all sampled before the update, are kept. Each cut
  choice goes on as a request of its own, from prompt + tokens so far, under the new version.

A completion whose tokens came from more than one version says where each run starts
(:class:`~streamer.rollout.contract.Completion` ``switches``); its ``version`` is the first.
A stream that breaks (transport error, 5xx) is asked again whole, like an unstreamed request.
"""

from __future__ import annotations

import json
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from producers.completions import parse_choice
from producers.samplers import Completion, SamplerError

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class _Run:
    """One choice as it streams in: token ids, log-probs, where each version's tokens start."""

    def __init__(self):
        self.ids: list[int] = []
        self.logprobs: list = []
        self.switches: list[tuple[int, int]] = []
        self.finish: str | None = None
        self.cut = False
        self.first: int | None = None  # the version of the first chunk (tokens or not)

    def add(self, choice: dict, version: int) -> None:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:  # older vLLM: "token_id:{id}" strings
            ids = [t.removeprefix("token_id:") for t in (lp.get("tokens") or [])]
            ids = [int(t) if t.isdigit() else t for t in ids]
        lps = lp.get("token_logprobs") or []
        if self.first is None:
            self.first = version
        if ids and (not self.switches or self.switches[-1][1] != version):
            self.switches.append((len(self.ids), version))
        self.ids += ids
        self.logprobs += lps
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]

    def then(self, more: _Run) -> None:
        """Append a continuation's tokens (its versions after ours)."""
        for start, version in more.switches:
            if not self.switches or self.switches[-1][1] != version:
                self.switches.append((len(self.ids) + start, version))
        self.ids += more.ids
        self.logprobs += more.logprobs
        self.finish, self.cut = more.finish, more.cut
        self.first = self.first if self.first is not None else more.first

    def completion(self, stop_ids: list[int]) -> Completion:
        done = parse_choice(
            {
                "token_ids": self.ids,
                "logprobs": {"token_logprobs": self.logprobs},
                "finish_reason": self.finish,
            },
            stop_ids,
        )
        n = len(done.token_ids)
        switches = tuple((a, v) for a, v in self.switches if a < n) or ((0, self.first),)
        first = switches[0][1]
        return Completion(
            done.token_ids, done.logprobs, done.finish_reason, first, switches if len(switches) > 1 else None
        )


def sample(sampler, body: dict) -> list[Completion]:
    """``body``'s ``n`` completions, streamed, each token stamped with its version."""
    n, budget = int(body["n"]), int(body["max_tokens"])
    runs = _stream(sampler, body)
    if any(r.finish is None and not r.cut and not r.ids for r in runs):
        raise SamplerError(f"{sampler.base_url}: a stream ended with no token and no finish reason")
    cut = [r for r in runs if _unfinished(r, budget)]
    if cut:
        with ThreadPoolExecutor(len(cut), thread_name_prefix="continue") as pool:
            list(pool.map(lambda r: _go_on(sampler, body, r, budget), cut))
    for r in runs:
        if r.finish is None or r.finish == "abort":  # ran out of budget across the cut
            r.finish = "length"
    if any(r.first is None for r in runs):
        raise SamplerError(f"{sampler.base_url}: asked for {n} completions, a streamed one never came")
    return [r.completion(sampler.stop_ids) for r in runs]


def _unfinished(run: _Run, budget: int) -> bool:
    return (run.cut or run.finish in (None, "abort")) and len(run.ids) < budget


def _go_on(sampler, body: dict, run: _Run, budget: int) -> None:
    """Continue a cut choice from prompt + its tokens so far until it finishes."""
    while _unfinished(run, budget):
        more = {**body, "prompt": [*body["prompt"], *run.ids], "n": 1, "max_tokens": budget - len(run.ids)}
        if "min_tokens" in body:  # vLLM's: counted from this request's first token
            more["min_tokens"] = max(0, int(body["min_tokens"]) - len(run.ids))
        went_on = _stream(sampler, more)[0]
        if not went_on.ids and not went_on.cut and went_on.finish is None:
            raise SamplerError(f"{sampler.base_url}: a stream ended with no token and no finish reason")
        run.then(went_on)


def _stream(sampler, body: dict) -> list[_Run]:
    """One streamed request, retried whole on transport errors, 429 and 5xx."""
    body = {**body, "stream": True, **sampler.engine.stream_fields(sampler.server.mode)}
    attempt = 0
    while True:
        runs = [_Run() for _ in range(int(body["n"]))]
        with sampler._slots, sampler.server.flight() as flight:
            try:
                error, retryable, refused = _read(sampler, body, runs, flight), True, False
            except httpx.TransportError as e:
                error, retryable, refused = f"{type(e).__name__}: {e}", True, False
            except _Refused as e:
                error, retryable, refused = str(e), e.retryable, not e.retryable
            except (ValueError, KeyError, IndexError, TypeError) as e:  # a chunk that means nothing
                error, retryable, refused = f"bad stream chunk: {type(e).__name__}: {e}", False, True
        if error is None:
            return runs
        if not retryable or attempt >= sampler.retries:
            raise SamplerError(
                f"{sampler.base_url}/v1/completions: {error} (after {attempt + 1} attempts)", refused=refused
            )
        delay = min(sampler.max_backoff, sampler.backoff * 2**attempt) * (0.5 + random.random() / 2)
        log.warning(
            "%s/v1/completions: %s; retry %d/%d in %.2fs",
            sampler.base_url,
            error,
            attempt + 1,
            sampler.retries,
            delay,
        )
        time.sleep(delay)
        attempt += 1


class _Refused(Exception):
    def __init__(self, message: str, *, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def _read(sampler, body: dict, runs: list[_Run], flight) -> str | None:
    """Read one stream into ``runs``; None when it ended (or was cut), else the error."""
    deadline = time.monotonic() + sampler.timeout
    size = 0
    with sampler._http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code >= 400:
            text = resp.read()[:200].decode(errors="replace")
            raise _Refused(f"HTTP {resp.status_code}: {text}", retryable=resp.status_code in RETRY_STATUS)
        for line in resp.iter_lines():
            size += len(line)
            if size > sampler.max_reply_bytes:
                raise _Refused(
                    f"answer is over {sampler.max_reply_bytes} bytes (producer.max_reply_bytes)",
                    retryable=False,
                )
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"answer not complete after {sampler.timeout:.0f}s")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError("a chunk that is not an object")
            with flight.lock:
                version = flight.stamp()
                for choice in chunk.get("choices") or []:
                    runs[int(choice.get("index", 0))].add(choice, version)
            if flight.cut:  # an update wants in: keep what came, the engine aborts the rest
                for r in runs:
                    r.cut = r.finish is None
                break
    return None
