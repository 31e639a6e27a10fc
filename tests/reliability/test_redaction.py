"""Passwords never reach a log or a terminal, whatever characters they hold."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.parse

import pytest
from harness import report
from trainer_data import REPO

from streamer.server import EmbeddedServer

pytestmark = pytest.mark.slow

PASSWORDS = ["p#ss/w?rd", "a@b:c#d", "s3cr3t/../x?y=1#frag", "%23plain"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "streamer", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def _fragments(password: str) -> list[str]:
    """Pieces a parser could cut the password into (3+ characters)."""
    parts = {password, urllib.parse.quote(password, safe="")}
    for sep in "#/?@:":
        parts |= {p for piece in list(parts) for p in piece.split(sep)}
    return sorted(p for p in parts if len(p) >= 3)


@pytest.mark.parametrize("password", PASSWORDS)
def test_no_password_fragment_in_any_error(password, tmp_path):
    leaks = []
    for encoded in (password, urllib.parse.quote(password, safe="")):
        for host in ("127.0.0.1:1", "127.0.0.1:notaport"):
            url = f"redis://user:{encoded}@{host}/0"
            # `train` reports through the same connect and CLI path as `status`, at 5x the
            # start-up cost (torch): once per password is enough to show it
            roles = ("status", "train") if (encoded, host) == (password, "127.0.0.1:1") else ("status",)
            for role in roles:
                res = _run(role, "--redis-url", url, "--data-dir", str(tmp_path))
                out = res.stdout + res.stderr
                assert res.returncode != 0 and out.strip(), out
                leaks += [(role, url, f) for f in _fragments(password) if f in out]
    report("redaction", password_chars=repr(password), leaks=len(leaks))
    assert not leaks, leaks


def test_wrong_password_against_a_real_server_is_redacted(tmp_path):
    with EmbeddedServer(tmp_path / "v", password="right#one") as server:
        wrong = urllib.parse.quote("wr/0ng?xq9#z7k", safe="")
        url = f"redis://default:{wrong}@127.0.0.1:{server.port}/0"
        res = _run("status", "--redis-url", url)
    assert res.returncode == 1 and "authentication failed" in res.stderr, res.stderr
    assert not [f for f in _fragments("wr/0ng?xq9#z7k") if f in res.stderr], res.stderr
