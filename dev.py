#!/usr/bin/env python3
"""Bootstrap a local virtualenv on first use, then run the demo or the test suite.

    python3 dev.py up      # streamer up: embedded Valkey + trainer + producers + eval + metrics
    python3 dev.py test    # the whole test suite (what CI runs)
    python3 dev.py vllm    # only build vLLM's own virtualenv (test and up --engine vllm do it too)

Extra arguments pass through (``python3 dev.py up --steps 20``, ``python3 dev.py test -k bus``).
Only Python 3.11+ is needed; everything else goes into ./.venv, and vLLM (for the suite's
real-engine tests and ``up --engine vllm``) into a virtualenv of its own that is kept
between runs (streamer/vllm_server.py: ~/.cache/streamer/vllm-VERSION).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# Pin torch explicitly: an unpinned torch pulls a multi-GB CUDA build on a CPU box; this
# release is the CPU wheel where a local wheel store has it and the CUDA wheel on a GPU box.
TORCH = os.environ.get("STREAMER_TORCH", "torch==2.13.0")


def _python() -> Path:
    return VENV / "bin" / "python"


def _stamp() -> str:
    h = hashlib.sha256(TORCH.encode())
    h.update((ROOT / "pyproject.toml").read_bytes())
    return h.hexdigest()


def bootstrap() -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"streamer needs Python 3.11+, this is {sys.version.split()[0]}")
    stamp_file = VENV / ".streamer-stamp"
    if stamp_file.exists() and stamp_file.read_text() == _stamp():
        return
    if not _python().exists():
        print(f"creating {VENV} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"installing {TORCH} and streamer into {VENV} (first run only) ...", flush=True)
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[test]"], check=True)
    stamp_file.write_text(_stamp())


def bootstrap_vllm(*, required: bool) -> None:
    """vLLM's virtualenv (a few minutes the first time, then nothing). Not ``required`` (the
    test suite): a failed install is a warning, and the real-engine tests skip (fail in CI)."""
    code = "from streamer.vllm_server import install; install()"
    done = subprocess.run([str(_python()), "-c", code])
    if done.returncode != 0:
        if required:
            sys.exit("vLLM could not be installed (see above)")
        print("dev.py: vLLM could not be installed; its tests will not run", file=sys.stderr)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "test", "streamer", "vllm"):
        print(__doc__)
        return 2
    bootstrap()
    cmd, rest = argv[0], argv[1:]
    if cmd == "vllm" or cmd == "test" or (cmd == "up" and "--engine" in " ".join(rest)):
        bootstrap_vllm(required=cmd != "test")
    if cmd == "vllm":
        return 0
    if cmd == "test":
        args = [str(_python()), "-m", "pytest", *rest]
    elif cmd == "up":
        args = [str(VENV / "bin" / "streamer"), "up", *rest]
    else:
        args = [str(VENV / "bin" / "streamer"), *rest]
    os.chdir(ROOT)
    os.execv(args[0], args)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
