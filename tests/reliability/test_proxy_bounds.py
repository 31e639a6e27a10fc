"""The agent proxy under clients that misbehave: a body's declared length and the episode's
key are checked before the body is read, a connection that sends nothing is closed, the
connections served at once are bounded, a client that hangs up is no traceback, and a prompt
with no room under the token limit is refused before anything is sampled."""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading
import time

import anyio
import httpx
import pytest
from contexts import Scripted, context, threaded

from producers.components import load_task
from producers.proxy import MAX_PROMPT_TOKENS, ProxyServer
from streamer import demo

ROW = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}
GOOD = json.dumps({"model": "m", "messages": ROW["messages"]}).encode()


@pytest.fixture(scope="module")
def task():
    return load_task(demo.config(), dataset="demo", rows=[ROW])


@pytest.fixture
def proxies():
    """``proxies(**limits)``: a proxy of this test's own, stopped at the end."""
    made: list[ProxyServer] = []

    def make(**limits) -> ProxyServer:
        made.append(ProxyServer(**limits))
        return made[-1]

    yield make
    for proxy in made:
        proxy.httpd.shutdown()
        proxy.httpd.server_close()


def _in_session(proxy: ProxyServer, task, fn, *, sampler=None, max_seq_len: int = 0):
    """``fn(port, key)`` run in a thread while an episode's session is open (its engine calls
    run on this event loop, as in a producer)."""
    sampler = sampler or Scripted(task.renderer)

    async def main():
        with proxy.session(context(task, threaded(sampler), max_seq_len=max_seq_len)) as s:
            return await anyio.to_thread.run_sync(fn, proxy.httpd.server_address[1], s.endpoint.api_key)

    return anyio.run(main)


def _connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def _head(key: str | None, length: str | None, *, path: str = "/v1/chat/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> tuple[int, bytes]:
    """The status of the reply on ``sock`` and the whole reply (socket.timeout: no reply)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "key, length, status, says",
    [
        (None, "-1", 401, b"unknown API key"),  # no key: nothing of the body is read
        (None, "1000000", 401, b"unknown API key"),
        ("good", "-1", 400, b"Content-Length must be one byte count"),
        ("good", "12abc", 400, b"Content-Length must be one byte count"),
        ("good", None, 411, b"Content-Length is required"),
        ("good", str(400 << 20), 413, b"over the limit"),
    ],
)
def test_a_body_is_refused_from_its_headers_before_a_byte_of_it_is_read(
    task, proxies, key, length, status, says
):
    proxy = proxies()

    def call(port, episode_key):
        with _connect(port) as sock:
            sock.sendall(_head(episode_key if key == "good" else key, length))  # and no body
            start = time.monotonic()
            code, reply = _status(sock)
            return code, reply, time.monotonic() - start

    code, reply, seconds = _in_session(proxy, task, call)
    assert (code, seconds < 3) == (status, True), (reply, seconds)
    assert says in reply and b"Connection: close" in reply, reply


def test_a_connection_that_sends_nothing_is_closed_and_one_that_hangs_up_is_one_quiet_line(
    task, proxies, caplog, capfd
):
    caplog.set_level(logging.DEBUG)
    proxy = proxies(timeout=0.5)

    def stall_and_hang_up(port, key):
        idle, half = _connect(port), _connect(port)
        half.sendall(_head(key, "100") + b'{"model": "m"')  # 13 of 100 bytes, then a reset
        half.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        half.close()
        closed = _closed_by_server(idle, within=5)
        idle.close()
        with _connect(port) as sock:  # still serving
            sock.sendall(_head(key, str(len(GOOD))) + GOOD)
            return closed, _status(sock)[0]

    closed, status = _in_session(proxy, task, stall_and_hang_up)
    assert closed, "a silent connection is held open"
    assert status == 200
    _wait(lambda: "client gone" in caplog.text, "the reset connection's debug line")
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors and "Traceback" not in capfd.readouterr().err, errors


def test_a_request_that_trickles_in_is_cut_at_its_deadline(task, proxies):
    proxy = proxies(timeout=0.5)  # a request must arrive within 2 x 0.5 s

    def trickle(port, key):
        start = time.monotonic()
        with _connect(port) as sock:
            for byte in _head(key, str(len(GOOD))) + GOOD:  # a byte per 0.2 s: no read waits 0.5 s
                try:
                    sock.send(bytes([byte]))
                    if select.select([sock], [], [], 0.2)[0] and not sock.recv(1):
                        break  # closed by the server
                except ConnectionError:
                    break
            else:
                return None
        return time.monotonic() - start

    seconds = _in_session(proxy, task, trickle)
    assert seconds is not None and seconds < 5, f"{seconds}: the whole request was read"


def test_connections_served_at_once_are_bounded_and_the_next_are_refused_at_once(task, proxies, capfd):
    proxy = proxies(timeout=30, max_connections=4)
    threads_before = threading.active_count()

    def flood(port, key):
        stalled = [_connect(port) for _ in range(40)]
        for sock in stalled:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and never the rest
        answered: set[socket.socket] = set()
        deadline = time.monotonic() + 10
        while len(answered) < 36 and time.monotonic() < deadline:
            answered |= set(select.select([s for s in stalled if s not in answered], [], [], 0.2)[0])
        replies = [_status(sock) for sock in answered]
        refused = sum(code == 503 and b"4 connections are open" in reply for code, reply in replies)
        threads = threading.active_count() - threads_before
        for sock in stalled:
            sock.close()
        _wait(lambda: proxy.httpd.open == 0, "the stalled connections' threads to end")
        with _connect(port) as sock:
            sock.sendall(_head(key, str(len(GOOD))) + GOOD)
            return refused, threads, _status(sock)[0]

    refused, threads, status = _in_session(proxy, task, flood)
    assert refused == 36 and proxy.httpd.refused == 36
    assert threads <= 4 + 2, f"{threads} threads for 40 stalled connections"  # + the session's worker
    assert status == 200, "served again once the stalled connections closed"
    assert "Traceback" not in capfd.readouterr().err, "closing stalled connections printed tracebacks"


def test_a_prompt_over_the_token_limit_is_refused_before_it_is_sampled(task, proxies):
    proxy = proxies()
    sampler = Scripted(task.renderer)
    huge = json.dumps({"messages": [{"role": "user", "content": "1+1=" * (MAX_PROMPT_TOKENS // 4 + 10)}]})

    def call(port, key):
        with _connect(port, timeout=60) as sock:
            sock.sendall(_head(key, str(len(huge))) + huge.encode())
            return _status(sock)

    code, reply = _in_session(proxy, task, call, sampler=sampler)  # trainer.max_seq_len = 0
    assert code == 400 and f"no room under {MAX_PROMPT_TOKENS} tokens".encode() in reply, reply
    assert not sampler.prompts


def _wait(done, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_megabyte_prompt_is_refused_before_it_is_rendered(task, proxies):
    proxy = proxies()
    sampler = Scripted(task.renderer)
    huge = json.dumps({"messages": [{"role": "user", "content": "1+1=" * 250_000}]})  # 1 MB

    def call(port, key):
        with _connect(port, timeout=60) as sock:
            start = time.monotonic()
            sock.sendall(_head(key, str(len(huge))) + huge.encode())
            return *_status(sock), time.monotonic() - start

    code, reply, seconds = _in_session(proxy, task, call, sampler=sampler)
    assert code == 400 and b"1000000 characters: too many for 32768 tokens" in reply, reply
    assert seconds < 2 and not sampler.prompts, f"{seconds:.1f}s"


def test_a_hostile_engine_answer_to_an_agent_is_a_502_and_drops_the_rollout_with_its_reason(task, caplog):
    from producers.proxy import proxied
    from streamer.errors import EpisodeRejected

    class Hostile(Scripted):
        def sample(self, *args, **kwargs):
            raise EpisodeRejected(
                "bad_token", "the engine sent token id 9223372036854775808, not an int32 id"
            )

    seen: list[int] = []

    @proxied
    async def agent(row, endpoint):
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                endpoint.base_url + "/chat/completions",
                json={"model": "m", "messages": row["messages"]},
                headers={"Authorization": f"Bearer {endpoint.api_key}"},
            )
        seen.append(r.status_code)
        return 1.0

    with pytest.raises(BaseExceptionGroup) as group:
        anyio.run(agent, ROW, context(task, threaded(Hostile(task.renderer))))
    (error,) = group.value.exceptions
    assert seen == [502] and isinstance(error, EpisodeRejected) and error.reason == "bad_token"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "no traceback logged"
