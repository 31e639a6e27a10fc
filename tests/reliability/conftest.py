"""Fixtures of the reliability suite; the helpers live in harness.py."""

from __future__ import annotations

import pytest
from harness import NoisyBackend, Procs

from producers.fake_server import FakeCompletionsServer


@pytest.fixture
def procs(tmp_path):
    """Role processes of this test; whatever still runs at the end is killed."""
    p = Procs(tmp_path)
    yield p
    p.kill_all()


@pytest.fixture
def inference():
    """A fake OpenAI-compatible server answering with a seeded :class:`NoisyBackend`."""
    backend = NoisyBackend(seed=7)
    with FakeCompletionsServer(backend) as server:
        yield server, backend
        backend.open()  # held requests of killed producers finish (into closed sockets)
