"""ruff (format + lint, configured in pyproject.toml) is the style: a finding fails the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    if found := shutil.which("ruff"):
        return [found]
    pytest.fail("ruff is not installed: it comes with the test extra (pip install -e '.[test]')")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    out = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff {' '.join(args)} found problems:\n{out.stdout}{out.stderr}"
