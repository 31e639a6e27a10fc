"""What a test needs from the machine: skipped with a reason locally, a failure under CI.

CI (`CI=true`, as .ci/run and hosted runners set it) installs every tool the suite uses, so
a missing one there means a broken CI image, not an optional extra: the test must fail
rather than pass silently as a skip.
"""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need(ok: bool, reason: str) -> None:
    """Go on when ``ok``; otherwise skip with ``reason``, or fail under CI."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"CI=true, and {reason}", pytrace=False)
    pytest.skip(reason)


def need_tool(name: str, install: str) -> str:
    """The path of executable ``name``; ``install`` says how to get it (e.g. the apt package)."""
    path = shutil.which(name)
    need(path is not None, f"`{name}` is not installed ({install})")
    return path
