"""Inference engines as named profiles: how a new policy version reaches each one.

``producer.engine`` picks one; the sampling request (``/v1/completions`` with token ids and
log-probs, :mod:`producers.remote_sampler`) is the same for all of them. What differs:

============  ===========================================================  ==========================
engine        full weights (a version directory on a shared filesystem)    LoRA adapter version
============  ===========================================================  ==========================
``vllm``      ``POST /collective_rpc {"method": "reload_weights",            ``POST /v1/load_lora_adapter``
              "kwargs": {"weights_path": dir}}`` (server started with
              ``VLLM_SERVER_DEV_MODE=1``), then ``POST /reset_prefix_cache``
              (without it, prompts that fill a KV block reuse KV computed
              by the old weights)
``sglang``    ``POST /update_weights_from_disk {"model_path": dir}``        ``POST /load_lora_adapter``
``openai``    none: a plain OpenAI-compatible server cannot follow           none
              versions; samples keep the version it started with
============  ===========================================================  ==========================

``producer.reload_endpoint`` / ``producer.lora_endpoint``, when set, replace the profile's
call with ``POST {endpoint} {"model_path": dir}`` / the LoRA endpoint (any engine that
speaks SGLang's shape). vLLM's reload leaves a tied ``lm_head`` at its start-up weights, so
for ``vllm`` the trainer writes every version untied (``lm_head.weight`` stored, config
untied): serve vLLM from an untied checkpoint (docs/ENGINES.md).

Around a full-weight reload, :class:`producers.reload.ServerVersions` runs the in-flight
protocol of ``producer.inflight_updates`` with each profile's :meth:`Engine.pause`,
:meth:`Engine.reset` and :meth:`Engine.resume`:

============  ==========================================  ==========================================
engine        pause (drain / abort / keep)                reset, resume
============  ==========================================  ==========================================
``vllm``      ``POST /pause?mode=wait|abort|keep``          ``POST /reset_prefix_cache`` (with
                                                          ``reset_running_requests=true`` for keep:
                                                          running requests recompute their KV),
                                                          its ``{"success": ...}`` checked;
                                                          ``POST /resume``
``sglang``    drain: none (``/update_weights_from_disk``  the reload flushes the cache;
              waits for requests itself); abort / keep:   ``POST /continue_generation``
              ``POST /pause_generation {"mode":
              "abort"|"retract"}`` (retract: requests
              recompute under the new weights)
other         none: drain and abort work client-side,     none
              keep is refused at start
============  ==========================================  ==========================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from streamer.errors import SamplerError

log = logging.getLogger(__name__)

NAMES = ("vllm", "sglang", "openai")

# (path, body, as_json) -> the server's answer; RemoteSampler._post (retries, errors)
Post = Callable[..., object]


class Engine:
    """The plain OpenAI-compatible profile: sampling only, no way to load new weights."""

    name = "openai"
    follows_versions = False  # False: samples stay stamped with the version the server started with
    lora_load = ""  # endpoint that loads a named adapter; "" = none
    lora_unload = ""

    def __init__(self, *, reload_endpoint: str = "", lora_endpoint: str = ""):
        self.reload_endpoint = reload_endpoint
        if lora_endpoint:
            self.lora_load = lora_endpoint
            self.lora_unload = lora_endpoint.replace("load_lora_adapter", "unload_lora_adapter")
            if self.lora_unload == self.lora_load:
                self.lora_unload = ""
        if reload_endpoint:
            self.follows_versions = True

    def reload(self, post: Post, directory: Path) -> None:
        """Make the server serve the full weights in ``directory`` (SamplerError if it cannot)."""
        if not self.reload_endpoint:
            raise SamplerError(f"engine {self.name!r} cannot load new weights", refused=True)
        answer = post(self.reload_endpoint, {"model_path": str(directory)})
        _check_success(answer, directory)

    # the in-flight protocol (producers.reload): what the server does around a reload
    def pause(self, post: Post, mode: str) -> None:
        """Hold generation for an update in ``mode`` (here: nothing; requests were drained or cut
        by their clients, and keep was refused at start)."""

    def reset(self, post: Post, *, running: bool) -> None:
        """Drop KV computed by the old weights (``running``: that of running requests too)."""

    def resume(self, post: Post) -> None:
        """Generate again after :meth:`pause`."""

    def missing(self, get) -> str:
        """What this server lacks for the in-flight protocol ("" = nothing); ``get(path)`` is
        the HTTP status of a GET."""
        return "" if not self.follows_versions else "a way to pause generation"

    def stream_fields(self, mode: str) -> dict:
        """Request fields of a streamed request in ``mode`` (producers.streaming)."""
        return {}


class Vllm(Engine):
    name = "vllm"
    follows_versions = True
    lora_load, lora_unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    RESET_TRIES = 5  # a reset fails while a request holds KV blocks; paused, none should

    def reload(self, post: Post, directory: Path) -> None:
        if self.reload_endpoint:
            return super().reload(post, directory)
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
        answer = post("/collective_rpc", body)
        _check_success(answer, directory)

    def pause(self, post: Post, mode: str) -> None:
        answer = post(f"/pause?mode={'wait' if mode == 'drain' else mode}", {})
        if not (isinstance(answer, dict) and answer.get("status") == "paused"):
            raise SamplerError(f"vLLM did not pause ({mode}): {str(answer)[:200]}", refused=True)

    def reset(self, post: Post, *, running: bool) -> None:
        path = f"/reset_prefix_cache?reset_running_requests={'true' if running else 'false'}"
        for attempt in range(self.RESET_TRIES):
            answer = post(path, {})
            if isinstance(answer, dict) and answer.get("success") is True:
                return
            time.sleep(0.05 * 2**attempt)
        raise SamplerError(
            f"vLLM did not reset its prefix cache after {self.RESET_TRIES} tries ({str(answer)[:200]}): "
            "KV computed by the old weights would be reused",
            refused=True,
        )

    def resume(self, post: Post) -> None:
        post("/resume", {})

    def stream_fields(self, mode: str) -> dict:
        # abort: tokens in chunks of 16 (a cut request loses at most the unsent ones, which its
        # continuation samples again). keep: every token at once, or tokens the old weights
        # sampled could wait in the server's buffer until after the resume
        return {"stream_interval": 16} if mode == "abort" else {}

    def missing(self, get) -> str:
        status = get("/is_paused")
        if status == 404:
            return "/pause, /resume and /is_paused (vLLM >= 0.32 started with VLLM_SERVER_DEV_MODE=1)"
        return ""


class Sglang(Engine):
    name = "sglang"
    follows_versions = True
    lora_load, lora_unload = "/load_lora_adapter", "/unload_lora_adapter"

    def __init__(self, *, reload_endpoint: str = "", lora_endpoint: str = ""):
        super().__init__(
            reload_endpoint=reload_endpoint or "/update_weights_from_disk", lora_endpoint=lora_endpoint
        )

    def pause(self, post: Post, mode: str) -> None:
        if mode != "drain":  # retract: running requests go back to the queue and recompute later
            post("/pause_generation", {"mode": "abort" if mode == "abort" else "retract"})

    def resume(self, post: Post) -> None:
        post("/continue_generation", {})

    def missing(self, get) -> str:
        return ""


PROFILES: dict[str, type[Engine]] = {"vllm": Vllm, "sglang": Sglang, "openai": Engine}


def profile(name: str, *, reload_endpoint: str = "", lora_endpoint: str = "") -> Engine:
    """The engine profile ``name`` (one of :data:`NAMES`), with the config's overrides."""
    try:
        cls = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(NAMES)}") from None
    return cls(reload_endpoint=reload_endpoint, lora_endpoint=lora_endpoint)


def _check_success(answer, directory: Path) -> None:
    """SGLang answers ``{"success": false, "message": ...}``; vLLM's collective_rpc an error status
    (raised by the caller) or ``{"results": [...]}``."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SamplerError(
            f"server refused to load {directory}: {answer.get('message', answer)}", refused=True
        )
