"""The base of the producer side's small local HTTP servers (the agent proxy, the fake
completions server of tests and benches): JSON replies, HTTP/1.1 keep-alive, no access log,
served from a daemon thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    def send_json(self, status: int, payload: dict) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json")

    def send_body(self, status: int, raw: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:  # quiet
        pass


def server(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A threading server on a free port of ``host``; :func:`start` serves it."""
    httpd = ThreadingHTTPServer((host, 0), handler)
    httpd.daemon_threads = True
    return httpd


def start(httpd: ThreadingHTTPServer, name: str = "httpd") -> threading.Thread:
    thread = threading.Thread(target=httpd.serve_forever, name=name, daemon=True)
    thread.start()
    return thread
