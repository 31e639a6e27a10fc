"""A small OpenAI-compatible completions server for tests and benches (stdlib only).

It speaks the subset of vLLM's ``/v1/completions`` the remote sampler uses: token-id
``prompt``, ``n``, ``logprobs``, ``return_token_ids`` (answered in ``choices[i].token_ids``)
and ``return_tokens_as_token_ids`` (``"token_id:{id}"`` strings in
``choices[i].logprobs.tokens``), plus the reload calls of both engine profiles (SGLang's ``/update_weights_from_disk``,
vLLM's ``/collective_rpc`` ``reload_weights`` + ``/reset_prefix_cache``) and vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (recorded in ``adapters``). What it
generates comes from a ``backend(body) -> list[Completion]``: a real local sampler, or a
canned answer after a fixed latency (the test double for a remote inference server).

It models the engines' in-flight controls too: vLLM's ``/pause?mode=wait|abort|keep``,
``/resume``, ``GET /is_paused`` and ``/reset_prefix_cache`` (``{"success": ...}``), and
SGLang's ``/pause_generation {"mode": "abort"|"retract"|"in_place"}`` and
``/continue_generation``. While paused, new requests queue; a streamed request
(``"stream": true``, one SSE chunk per token every ``token_delay`` seconds) stops between
tokens and, paused to abort, ends with finish reason ``abort``; a wait-mode pause returns
once no request is in flight. ``version`` is what the last reload loaded (a counter), and
each streamed token's chunk carries the version that produced it as ``x_version`` (and,
with ``mark_versions``, every token's log-prob is ``-(version + 1) / 100``), so a test can
check a client's stamps token by token. ``pauses`` is False for a server without
the pause routes (404, as vLLM without dev mode).

Test hooks: ``hold`` (clear it to make requests wait; ``pass_first`` lets the first k
through, such as a producer's readiness probe), ``fail_next`` (answer the next k requests
with an error status), ``reset_fails`` (answer the next k cache resets ``success: false``),
and counters of requests, in-flight peak and reloads.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from producers import httpd
from producers.httpd import JsonHandler
from producers.samplers import Completion

Backend = Callable[[dict], list[Completion]]


class BadRequest(Exception):
    """Raised by a backend: the request is answered 400 with this message (as vLLM answers a
    prompt longer than the model's context)."""


def canned(token_ids: list[int], logprob: float = -0.5, finish: str = "stop") -> Backend:
    """A backend answering every request with ``n`` copies of one completion."""

    def backend(body: dict) -> list[Completion]:
        return [Completion(list(token_ids), [logprob] * len(token_ids), finish)] * int(body.get("n", 1))

    return backend


def from_sampler(sampler) -> Backend:
    """A backend that runs a local sampler on the request (the same structures, served)."""

    def backend(body: dict) -> list[Completion]:
        return sampler.sample(
            body["prompt"],
            n=int(body.get("n", 1)),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            max_new_tokens=int(body.get("max_tokens", 16)),
            seed=body.get("seed"),
        )

    return backend


class FakeCompletionsServer:
    def __init__(
        self,
        backend: Backend,
        *,
        latency: float = 0.0,
        token_ids_field: bool = True,
        host: str = "127.0.0.1",
        token_delay: float = 0.0,
        pauses: bool = True,
        mark_versions: bool = False,
    ):
        self.backend, self.latency, self.token_ids_field = backend, latency, token_ids_field
        self.token_delay, self.pauses = token_delay, pauses
        self.mark_versions = mark_versions  # each token's log-prob says the version: -(v + 1) / 100
        self.version = 0  # reloads done: the weights that produce the tokens now
        self.paused = ""  # "" = generating; else the pause mode
        self.resumed = threading.Condition()
        self.reset_fails = 0
        self.hold = threading.Event()
        self.hold.set()  # clear() to make requests wait until set() again
        self.pass_first = 0  # completions requests answered before hold and started apply (a probe)
        self.started = threading.Event()  # set when a completions request arrives
        self.requests = 0
        self.in_flight = self.max_in_flight = 0
        self.reloads: list[str] = []  # weights directories loaded (either engine's reload call)
        self.cache_resets = 0
        self.paths: list[str] = []  # every POST other than completions, in order (reload calls)
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.bodies: list[dict] = []
        self._fail: list[int] = []
        self._lock = threading.Lock()
        self._server = httpd.server(_handler(self), host)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeCompletionsServer:
        httpd.start(self._server, "fake-completions")
        return self

    def stop(self) -> None:
        self.hold.set()
        self._server.shutdown()
        self._server.server_close()

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._fail.extend([status] * count)

    def clear_failures(self) -> None:
        """Answer normally again (the failures fail_next queued and not yet used are dropped)."""
        with self._lock:
            self._fail.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def answer(self, body: dict) -> tuple[int, dict]:
        """(status, JSON) for a completions request."""
        with self._lock:
            self.requests += 1
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            status = self._fail.pop(0) if self._fail else 200
            passed = self.requests <= self.pass_first
        try:
            if not passed:
                self.started.set()
                self.hold.wait()
            self._wait_resumed()
            if self.latency:
                time.sleep(self.latency)
            if status != 200:
                return status, {"object": "error", "message": "injected failure", "code": status}
            prompt = body.get("prompt")
            if not isinstance(prompt, list) or not all(isinstance(i, int) for i in prompt):
                return 400, {"object": "error", "message": "prompt must be token ids", "code": 400}
            try:
                completions = self.backend(body)
            except BadRequest as e:
                return 400, {"object": "error", "message": str(e), "code": 400}
            if self.token_delay and not body.get("stream"):  # as long as streaming it would take
                time.sleep(self.token_delay * max((len(c.token_ids) for c in completions), default=0))
            if self.mark_versions:
                mark = -(self.version + 1) / 100
                completions = [
                    Completion(c.token_ids, [mark] * len(c.token_ids), c.finish_reason) for c in completions
                ]
            return 200, self._response(body, completions)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _response(self, body: dict, completions: list[Completion]) -> dict:
        choices = []
        for i, c in enumerate(completions):
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            tokens = [f"token_id:{t}" if as_ids else f"<{t}>" for t in c.token_ids]
            choice = {
                "index": i,
                "text": "",
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "logprobs": {
                    "text_offset": list(range(len(tokens))),
                    "tokens": tokens,
                    "token_logprobs": list(c.logprobs),
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, c.logprobs)],
                },
            }
            if self.token_ids_field and body.get("return_token_ids"):
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = None
            choices.append(choice)
        n_out = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"cmpl-{self.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": n_out,
                "total_tokens": len(body["prompt"]) + n_out,
            },
        }

    # ------------------------------------------------------------ pauses and streams

    def _wait_resumed(self) -> None:
        with self.resumed:
            self.resumed.wait_for(lambda: not self.paused)

    def pause(self, mode: str) -> None:
        with self.resumed:
            self.paused = mode
            if mode == "wait":  # vLLM: once the requests in flight are done
                self.resumed.wait_for(lambda: self.in_flight == 0, timeout=60)

    def resume(self) -> None:
        with self.resumed:
            self.paused = ""
            self.resumed.notify_all()

    def stream(self, handler, body: dict) -> None:
        """Answer a streamed request: one SSE chunk per token (see the module doc)."""
        status, answer = self.answer({**body, "stream": False})
        if status != 200:
            return handler.send_json(status, answer)
        with self._lock:
            self.in_flight += 1
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            for choice in answer["choices"]:
                self._stream_choice(handler, choice)
            handler.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left: the request is aborted
        finally:
            with self._lock:
                self.in_flight -= 1
            with self.resumed:
                self.resumed.notify_all()

    def _stream_choice(self, handler, choice: dict) -> None:
        ids, lps = choice.get("token_ids") or [], choice["logprobs"]["token_logprobs"]
        for k, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            with self.resumed:
                if self.paused in ("abort",):
                    return _chunk(handler, choice["index"], [], [], "abort", self.version)
                self.resumed.wait_for(lambda: not self.paused)
                version = self.version
            last = k == len(ids) - 1
            lp = -(version + 1) / 100 if self.mark_versions else lp
            _chunk(handler, choice["index"], [t], [lp], choice["finish_reason"] if last else None, version)
            if self.token_delay:
                time.sleep(self.token_delay)


def _chunk(handler, index: int, ids: list[int], lps: list[float], finish, version: int) -> None:
    choice = {"index": index, "text": "", "token_ids": ids, "finish_reason": finish, "x_version": version}
    choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps}
    handler.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
    handler.wfile.flush()


def _handler(server: FakeCompletionsServer):
    class Handler(JsonHandler):
        def do_GET(self):
            if self.path == "/is_paused" and server.pauses:
                return self.send_json(200, {"is_paused": bool(server.paused)})
            return self.send_json(404, {"object": "error", "message": f"no route {self.path}", "code": 404})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self.send_json(400, {"object": "error", "message": "bad JSON", "code": 400})
            if self.path == "/v1/completions":
                if body.get("stream"):
                    return server.stream(self, body)
                return self.send_json(*server.answer(body))
            server.paths.append(self.path)
            route = self.path.split("?")[0]
            if server.pauses and route in ("/pause", "/pause_generation"):
                mode = self.path.partition("mode=")[2] or body.get("mode", "abort")
                server.pause(mode)
                return self.send_json(200, {"status": "paused"})
            if server.pauses and route in ("/resume", "/continue_generation"):
                server.resume()
                return self.send_json(200, {"status": "resumed"})
            if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                name = body.get("lora_name", "")
                if self.path.startswith("/v1/load"):
                    server.adapters[name] = body.get("lora_path", "")
                else:
                    server.adapters.pop(name, None)
                return self.send_body(200, f"Success: LoRA adapter '{name}' updated.".encode())
            if self.path == "/update_weights_from_disk":
                if not server.paused:  # SGLang waits for the requests in flight itself
                    server.pause("wait")
                    server.resume()
                server.reloads.append(body.get("model_path", ""))
                server.version += 1
                return self.send_json(200, {"success": True, "message": "loaded"})
            if self.path == "/collective_rpc" and body.get("method") == "reload_weights":
                server.reloads.append(body.get("kwargs", {}).get("weights_path", ""))
                server.version += 1
                return self.send_json(200, {"results": [None]})
            if route == "/reset_prefix_cache":
                if server.reset_fails > 0:
                    server.reset_fails -= 1
                    return self.send_json(200, {"success": False})
                server.cache_resets += 1
                return self.send_json(200, {"success": True})
            return self.send_json(404, {"object": "error", "message": f"no route {self.path}", "code": 404})

    return Handler
