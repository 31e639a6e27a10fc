#!/usr/bin/env python3
"""Bootstrap a local virtualenv on first use, then run the demo or the test suite.

    python3 dev.py up      # streamer up: embedded Valkey + trainer + producers + eval + metrics
    python3 dev.py test    # the whole test suite (what CI runs)

Extra arguments pass through (``python3 dev.py up --steps 20``, ``python3 dev.py test -k bus``).
Only Python 3.11+ is needed; everything else goes into ./.venv.
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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "test", "streamer"):
        print(__doc__)
        return 2
    bootstrap()
    cmd, rest = argv[0], argv[1:]
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
