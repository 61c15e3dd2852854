"""Fixtures for the tiered-store tests: an S3 bucket (moto server) and a proxy that can hold a
request (the bucket manifest's PUT) for as long as a test wants, so a process can be killed with
its upload provably unfinished."""

from __future__ import annotations

import http.client
import http.server
import threading
from typing import Callable

import pytest

from backends import Backend

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class HoldProxy:
    """An HTTP proxy in front of moto. Requests for which ``hold(command, path)`` is true are held
    until :meth:`release` (then forwarded) or :meth:`drop` (then their connection is closed and
    they never reach moto, as if the client died first); every other request is forwarded.

    Attributes:
        held (list[str]): ``"COMMAND path"`` of each request held so far.
        endpoint_url (str): the proxy's URL (127.0.0.1, port chosen by the OS).
    """

    def __init__(self, upstream: str, hold: Callable[[str, str], bool]) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.hold = hold
        self.held: list[str] = []
        self._released = threading.Event()
        self._drop = False
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                if proxy.hold(self.command, self.path):
                    with proxy._lock:
                        proxy.held.append(f"{self.command} {self.path}")
                    proxy._released.wait()
                    if proxy._drop:
                        self.close_connection = True
                        return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers.pop("Content-Length", None)
                headers.pop("Expect", None)
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() in _HOP_BY_HOP or (key.lower() == "content-length" and self.command != "HEAD"):
                            continue
                        self.send_header(key, value)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._released.set()

    def drop(self) -> None:
        self._drop = True
        self._released.set()

    def stop(self) -> None:
        self.drop()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def bucket(s3_backend) -> Backend:
    """A clean S3 bucket on the moto server (HTTP on loopback)."""
    return s3_backend


@pytest.fixture
def hold_proxy(moto_s3):
    """Factory: ``hold_proxy(hold)`` starts a :class:`HoldProxy` in front of the moto server."""
    proxies = []

    def start(hold: Callable[[str, str], bool]) -> HoldProxy:
        proxy = HoldProxy(moto_s3.endpoint_url, hold)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()
