"""Fixtures: a private valkey-server per session (or per test, for tests that kill it).

Set STREAMER_TEST_REDIS_URL (e.g. redis://127.0.0.1:6379/0) to run the bus tests against
another server as well; each test uses its own run namespace and deletes only its keys.
"""

from __future__ import annotations

import os
import uuid

import pytest

from streamer.connection import connect
from streamer.keys import Keys
from streamer.server import EmbeddedServer


@pytest.fixture(scope="session")
def valkey(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.stop()


@pytest.fixture
def private_valkey(tmp_path):
    """A server of this test's own, which the test may kill and restart."""
    server = EmbeddedServer(tmp_path / "valkey", appendfsync="always").start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(valkey) -> str:
    return os.environ.get("STREAMER_TEST_REDIS_URL") or valkey.url


@pytest.fixture
def keys(redis_url):
    """A unique run namespace; its keys are deleted afterwards (and nothing else)."""
    k = Keys(f"t{uuid.uuid4().hex[:12]}")
    yield k
    client = connect(redis_url)
    for key in client.scan_iter(match=k.all_keys_pattern(), count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def client(redis_url):
    c = connect(redis_url, socket_timeout=10.0)
    yield c
    c.close()
