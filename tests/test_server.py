"""Connecting: URLs, unreachable and too-old servers, the embedded server's failures."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import redis

from streamer.connection import connect, redact
from streamer.errors import ConfigError, ServerError
from streamer.server import EmbeddedServer, free_port


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://localhost:6379", "scheme must be redis://, rediss://, unix:// or redis\\+cluster://"),
        ("localhost:6379", "scheme must be"),
        ("redis://", "has no host"),
        ("unix://", "has no socket path"),
        ("redis://:pw@host:notaport/0", "Port could not be cast|invalid"),
    ],
)
def test_malformed_urls(url, message):
    with pytest.raises(ConfigError, match=message):
        connect(url)


def test_unreachable_server_is_one_clear_line():
    port = free_port()
    with pytest.raises(ServerError) as err:
        connect(f"redis://:hunter2@127.0.0.1:{port}/0", socket_timeout=1.0)
    msg = str(err.value)
    assert msg.startswith(f"cannot reach the server at redis://:***@127.0.0.1:{port}/0")
    assert "hunter2" not in msg and "\n" not in msg


def test_redact_hides_passwords_only():
    assert redact("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def _fake_old_server(version: str) -> int:
    """A RESP peer that reports an old server version (no Redis < 6.2 is installable here)."""
    listener = socket.create_server(("127.0.0.1", 0))
    info = f"# Server\r\nredis_version:{version}\r\n".encode()

    def serve():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn):
        with conn:
            buf = b""
            while data := conn.recv(4096):
                buf += data
                while b"\r\n" in buf and buf.startswith(b"*"):
                    n = int(buf[1 : buf.index(b"\r\n")])
                    parts = buf.split(b"\r\n")
                    if len(parts) < 1 + 2 * n + 1:
                        break
                    cmd = parts[2].upper()
                    buf = b"\r\n".join(parts[1 + 2 * n :])
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(info), info) if cmd == b"INFO" else b"+OK\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_server_too_old_for_xautoclaim():
    port = _fake_old_server("5.0.7")
    with pytest.raises(ServerError, match=r"version 5\.0\.7; streamer needs >= 6\.2 \(XAUTOCLAIM\)"):
        connect(f"redis://127.0.0.1:{port}/0", socket_timeout=2.0)


@pytest.mark.slow
def test_embedded_server_restarts_on_its_port_with_its_data(tmp_path):
    server = EmbeddedServer(tmp_path / "v", appendfsync="always").start()
    try:
        c = connect(server.url)
        c.set("k", "v")
        port = server.port
        server.kill()
        server.start()
        assert server.port == port and connect(server.url).get("k") == b"v"
    finally:
        server.stop()


@pytest.mark.slow
def test_embedded_server_that_cannot_start_says_why(tmp_path):
    with EmbeddedServer(tmp_path / "a") as first:
        clash = EmbeddedServer(tmp_path / "b", port=first.port)
        with pytest.raises(ServerError, match="exited with code"):
            clash.start(timeout=10)


def test_a_command_to_a_stalled_server_raises_within_its_retries(private_valkey):
    """A stalled server (SIGSTOP) answers nothing: a command on a connection it has yet to
    make raises after the client's few retries rather than hanging on for the outage, so
    the caller can say so (a heartbeat, a producer's loop)."""
    client = connect(private_valkey.url, socket_timeout=1.0, check=False)  # no connection yet
    os.kill(private_valkey.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            client.set("k", 1)
        took = time.monotonic() - start
    finally:
        os.kill(private_valkey.proc.pid, signal.SIGCONT)
    # 4 tries of 1 s and their backoff; nested health-check retries made it over 16 s
    assert took < 10.0, f"the command took {took:.1f}s to fail"
    assert client.set("k", 2)  # and the same client carries on once the server does
