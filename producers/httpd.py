"""The base of the producer side's small local HTTP servers (the agent proxy, the fake
completions server of tests and benches): JSON replies, HTTP/1.1 keep-alive, no access log,
served from a daemon thread.

Bounded for clients that misbehave: :meth:`JsonHandler.read_body` checks the declared length
before it reads a byte (none: 411; not a byte count: 400; over the limit: 413); a server
made with ``timeout`` drops a connection that sends nothing for that long (an idle
keep-alive one too) or takes more than twice that to send one request (a byte at a time
resets no per-read timeout), and one made with ``max_connections`` serves at most that many
connections at once, answering the next ones 503 at once instead of starting a thread for
each. A client that hangs up or times out is one debug line, never a traceback.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

GONE = (ConnectionError, TimeoutError)  # the client hung up, or sent nothing in time


class HTTPError(Exception):
    """A request answered with ``status`` and this message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    deadline = 0.0  # monotonic time by which the request being read must have arrived

    def setup(self) -> None:
        super().setup()
        if self.timeout is not None:  # reads bounded in total, not only per recv
            self.rfile.close()  # the socket's own file: unused, it would keep the socket open
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        if self.timeout is not None:
            self.deadline = time.monotonic() + 2 * self.timeout
        super().handle_one_request()

    def read_body(self, limit: int) -> bytes:
        """The request's body, at most ``limit`` bytes; :class:`HTTPError` before reading any
        of it when its length is missing, not a byte count or over ``limit``."""
        keep = self.close_connection
        self.close_connection = True  # the stream is not reusable until the body is read
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise HTTPError(411, "a chunked body is not accepted: send Content-Length")
        declared = set(self.headers.get_all("Content-Length") or [])
        if not declared:
            raise HTTPError(411, "Content-Length is required")
        raw = declared.pop().strip()
        if declared or not raw.isascii() or not raw.isdigit():
            raise HTTPError(400, "Content-Length must be one byte count")
        if int(raw) > limit:
            raise HTTPError(413, f"a body of {raw} bytes is over the limit of {limit}")
        body = self.rfile.read(int(raw))
        if len(body) < int(raw):
            raise ConnectionError(f"the client hung up after {len(body)} of {raw} bytes")
        self.close_connection = keep
        return body

    def send_json(self, status: int, payload: dict) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json")

    def send_body(self, status: int, raw: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:  # quiet
        pass


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by the handler's per-read timeout and request deadline."""

    def __init__(self, sock: socket.socket, handler: JsonHandler):
        self.sock, self.handler = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(min(left, self.handler.timeout))
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.handler.timeout)


class Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them (0 = no limit)."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of agents connecting at once waits in it

    def __init__(self, address, handler, *, max_connections: int = 0):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self.open = 0  # connections being served
        self.refused = 0  # connections answered 503 because max_connections were open

    def process_request(self, request, client_address) -> None:
        with self._lock:
            full = bool(self.max_connections) and self.open >= self.max_connections
            self.open += not full
            self.refused += full
        if full:
            return self._refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed()

    def _closed(self) -> None:
        with self._lock:
            self.open -= 1

    def _refuse(self, request) -> None:
        """503 without waiting on the client (the accept loop must never block on one)."""
        message = f"busy: {self.max_connections} connections are open; retry later"
        raw = json.dumps({"error": {"message": message, "type": "server_error", "code": 503}}).encode()
        head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(raw)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        try:
            request.setblocking(False)
            request.send(head.encode() + raw)
            request.recv(65536)  # what the client sent already: unread, the close would be a reset
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, GONE):
            log.debug("%s: client %s gone: %s", type(self).__name__, client_address, error)
            return
        log.error("request from %s failed", client_address, exc_info=True)


def server(
    handler: type[BaseHTTPRequestHandler],
    host: str = "127.0.0.1",
    *,
    timeout: float | None = None,
    max_connections: int = 0,
) -> Server:
    """A threading server on a free port of ``host``; :func:`start` serves it. ``timeout``:
    seconds a connection may send nothing (None = no limit)."""
    if timeout is not None:
        handler = type(
            handler.__name__, (handler,), {"timeout": timeout}
        )  # socketserver's per-connection timeout
    return Server((host, 0), handler, max_connections=max_connections)


def start(httpd: ThreadingHTTPServer, name: str = "httpd") -> threading.Thread:
    thread = threading.Thread(target=httpd.serve_forever, name=name, daemon=True)
    thread.start()
    return thread
