"""HTTP proxies on loopback in front of an S3 server (moto, SeaweedFS), for fault and timing tests
(the same proxies speak GCS's JSON API in front of fake-gcs-server: :mod:`opd_testkit.gcs`).

Clients (s3fs, boto3) talk to a proxy's :attr:`~S3Proxy.endpoint_url`; it forwards each request to
the server unchanged unless it was told otherwise:

* :class:`S3FaultProxy` answers requests picked by a :class:`Rule` with a fault, exactly as a real
  S3 endpoint or a broken network would:

  ==================  ======================================================================
  ``status``          an S3 XML error with that HTTP status and error code (``500
                      InternalError``, ``503 SlowDown``, ``403 AccessDenied``); the request
                      never reaches the server
  ``drop``            the connection is closed without any response; the request never
                      reaches the server
  ``drop_after``      the request is forwarded (so it *lands*), then the connection is closed
                      without a response: the ambiguous outcome of a lost reply
  ``truncate``        the request is forwarded, the status line, headers and half the body
                      are sent, then the connection is closed (dropped mid-response)
  ``short``           the request is forwarded; the reply is complete and well formed, but
                      its body is the first half of the server's (``Content-Length`` says so)
  ``corrupt``         the request is forwarded; the reply carries the server's body with its
                      first byte flipped
  ``corrupt_request`` the request is forwarded with the first byte of its body flipped (a
                      bit flip on the way in); the server's reply comes back unchanged
  ``stall``           the request is read and never answered (a stuck gateway): the
                      connection stays open until the client gives up, the rules are
                      cleared or the proxy stops (then it is closed without a response)
  ``stall_body``      the request's headers are read and its body never is (a peer whose
                      receive window stays shut): the client's writes block once the socket
                      buffers are full; the connection is held as for ``stall``
  ==================  ======================================================================

* :class:`~opd_testkit.hold_proxy.HoldProxy` holds the requests a predicate picks until ``release()`` (then
  forwards them) or ``drop()`` (then closes their connection: they never land), so a
  process can be killed with an upload provably unfinished.

Every request is recorded (:attr:`S3Proxy.requests`) with its S3 operation
(:func:`~opd_testkit.s3.s3_operation`), the bytes received and sent, and the fault applied,
so tests assert request counts and bytes. Request bodies are read whole before forwarding
(chunked transfer encoding is decoded by the HTTP layer here: the server sees the client's bytes).
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import socket
import sys
import threading
from typing import Callable
from urllib.parse import urlsplit

from .s3 import s3_operation

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}

_ERROR_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "AccessDenied": "Access Denied",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclasses.dataclass
class Request:
    """One request seen by a proxy.

    Attributes:
        op: S3 operation name (:func:`~opd_testkit.s3.s3_operation`).
        method: HTTP method.
        path: URL path (``/bucket/key``), without the query.
        query: the query string.
        request_bytes: body bytes received from the client.
        response_bytes: body bytes sent back (0 for a dropped connection).
        status: HTTP status sent back (0 when the connection was dropped without a response).
        fault: the fault applied (``None`` when forwarded unchanged).
        headers: request headers as received (names lower-cased).
    """

    op: str
    method: str
    path: str
    query: str
    request_bytes: int
    response_bytes: int = 0
    status: int = 0
    fault: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Rule:
    """Which requests get which fault.

    Attributes:
        ops: S3 operation names to match (any when empty).
        match: extra predicate on the :class:`Request` (``path``, ``query``, ``headers`` filled in).
        fault: ``status``, ``drop``, ``drop_after``, ``truncate``, ``stall``, ``stall_body``,
            ``short``, ``corrupt`` or ``corrupt_request``.
        status: HTTP status for ``status`` faults.
        code: S3 error code for ``status`` faults (``SlowDown``, ``InternalError``, ``AccessDenied``).
        times: fault this many matching requests, then forward (``None``: every one).
        skip: let this many matching requests through first.
        hits: matching requests faulted so far.
    """

    ops: tuple[str, ...] = ()
    match: Callable[[Request], bool] | None = None
    fault: str = "status"
    status: int = 503
    code: str = "SlowDown"
    times: int | None = 1
    skip: int = 0
    hits: int = 0
    seen: int = 0

    def take(self, request: Request) -> bool:
        if self.ops and request.op not in self.ops:
            return False
        if self.match is not None and not self.match(request):
            return False
        self.seen += 1
        if self.seen <= self.skip:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


class _ProxyServer(http.server.ThreadingHTTPServer):
    """The proxies' server: a client hanging up mid-answer (a range cancelled, a connection a fault
    dropped) is what the tests do on purpose, so it prints no traceback; anything else still does."""

    daemon_threads = True
    # socketserver listens with a backlog of 5: hundreds of clients connecting at once overflow it,
    # the kernel drops their SYNs and each waits 1 s, 3 s, 7 s... to connect (a latency no object
    # store has, which made an unthrottled 64-rank save slower than a throttled one). The kernel
    # caps it at net.core.somaxconn.
    request_queue_size = 4096

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class S3Proxy:
    """A forwarding HTTP/1.1 proxy on 127.0.0.1 (port chosen by the OS) that records every request.

    Subclasses decide per request in :meth:`_decide`: ``None`` to forward it, or a fault name.

    Args:
        upstream (str): the server's endpoint URL (``http://127.0.0.1:PORT``).

    Attributes:
        endpoint_url (str): where clients connect.
        requests (list[Request]): every request, in arrival order.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
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

            def _drop(self) -> None:
                self.close_connection = True
                try:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _send_error(self, record: Request, status: int, code: str) -> None:
                content_type, payload = proxy.error_body(status, code)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                record.status = status
                if self.command != "HEAD":
                    record.response_bytes = len(payload)  # before the bytes leave (see _handle)
                    self.wfile.write(payload)

            def _handle(self) -> None:
                split = urlsplit(self.path)
                record = Request(
                    op=proxy.operation(self.command, split.path, split.query),
                    method=self.command,
                    path=split.path,
                    query=split.query,
                    request_bytes=0,
                    headers={k.lower(): v for k, v in self.headers.items()},
                )
                if proxy._decide_unread(record):  # returns once the stall ends
                    self._drop()
                    return
                body = self._body()
                record.request_bytes = len(body)
                with proxy.lock:
                    proxy.requests.append(record)
                fault = proxy._decide(record)
                if fault is not None and fault[0] == "status":
                    record.fault = f"{fault[1]} {fault[2]}"
                    self._send_error(record, fault[1], fault[2])
                    return
                record.fault = fault[0] if fault is not None else None
                if record.fault in ("drop", "stall"):
                    self._drop()
                    return
                if record.fault == "corrupt_request" and body:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                status, reason, headers, data = self._forward(body)
                if record.fault == "drop_after":
                    self._drop()
                    return
                self.send_response(status, reason)
                for key, value in headers:
                    if key.lower() in _HOP_BY_HOP or (key.lower() == "content-length" and self.command != "HEAD"):
                        continue
                    self.send_header(key, value)
                if record.fault == "short":
                    data = data[: len(data) // 2]
                elif record.fault == "corrupt" and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                record.status = status
                if self.command == "HEAD":
                    return
                # Final before the bytes leave: a test reads the record once its client has them.
                if record.fault == "truncate":
                    record.response_bytes = len(data) // 2
                    self.wfile.write(data[: len(data) // 2])
                    self._drop()
                    return
                record.response_bytes = len(data)
                self.wfile.write(data)

            def _forward(self, body: bytes):
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
                    return response.status, response.reason, response.getheaders(), data
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = _ProxyServer(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # serve_forever looks for stop() every poll interval: 0.5 s by default, half of it waited on
        # average by every test's teardown; a wake-up every 50 ms costs microseconds.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def operation(method: str, path: str, query: str) -> str:
        """The API operation a request is recorded as (S3's: :func:`~opd_testkit.s3.s3_operation`)."""
        return s3_operation(method, path, query)

    @staticmethod
    def error_body(status: int, code: str) -> tuple[str, bytes]:
        """``(content type, body)`` of a ``status`` fault's answer: S3's XML error naming ``code``."""
        return "application/xml", (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{_ERROR_MESSAGES.get(code, code)}</Message><RequestId>proxy</RequestId></Error>"
        ).encode()

    def _decide(self, record: Request) -> tuple | None:
        """``None`` to forward ``record``; ``("status", code, name)``, ``("drop",)``,
        ``("drop_after",)``, ``("truncate",)`` or ``("stall",)`` (returned once the stall ends: the
        connection is then closed without a response) for a fault. Runs on the request's thread."""
        return None

    def _decide_unread(self, record: Request) -> bool:
        """Before the body is read: ``True`` (returned once the stall ends; the connection is then
        closed without a response) to never read it (``stall_body``); the record is then recorded
        here. Runs on the request's thread."""
        return False

    def ops(self) -> list[str]:
        """Operation names of every recorded request, in order."""
        with self.lock:
            return [r.op for r in self.requests]

    def count(self, op: str, *, faulted: bool | None = None) -> int:
        """Requests of operation ``op`` (only faulted / only forwarded ones when given)."""
        with self.lock:
            return sum(
                1 for r in self.requests if r.op == op and (faulted is None or (r.fault is not None) == faulted)
            )

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class S3FaultProxy(S3Proxy):
    """The fault proxy. ``rules`` are tried in order; the first that takes a request decides its fault.

    Attributes:
        rules (list[Rule]): active rules (append or use :meth:`add`).
        fail_puts (int): answer the next N ``PUT`` requests with ``503 SlowDown``; their paths go
            to :attr:`failed`.
    """

    def __init__(self, upstream: str) -> None:
        self.rules: list[Rule] = []
        self.fail_puts = 0
        self.failed: list[str] = []
        self.released = threading.Event()  # set: the requests stalled so far are let go (dropped)
        super().__init__(upstream)

    def _decide_unread(self, record: Request) -> bool:
        with self.lock:
            rule = next((r for r in self.rules if r.fault == "stall_body" and r.take(record)), None)
            if rule is not None:
                record.fault = rule.fault
                self.requests.append(record)
            released = self.released
        if rule is None:
            return False
        released.wait()
        return True

    def _decide(self, record: Request) -> tuple | None:
        with self.lock:
            rule = next((r for r in self.rules if r.fault != "stall_body" and r.take(record)), None)
            if rule is None and record.method == "PUT" and self.fail_puts > 0:
                self.fail_puts -= 1
                self.failed.append(record.path + (f"?{record.query}" if record.query else ""))
                rule = Rule(fault="status", status=503, code="SlowDown")
            released = self.released
        if rule is None:
            return None
        if rule.fault == "stall":
            released.wait()  # then the connection is closed without a response, as for a drop
        return ("status", rule.status, rule.code) if rule.fault == "status" else (rule.fault,)

    def add(self, rule: Rule | None = None, **kwargs) -> Rule:
        """Append a rule (given, or built from ``kwargs``) and return it."""
        rule = rule if rule is not None else Rule(**kwargs)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule and every recorded request; let stalled requests go (dropped)."""
        with self.lock:
            self.rules.clear()
            self.requests.clear()
            self.failed.clear()
            self.fail_puts = 0
            self.released.set()
            self.released = threading.Event()

    def stop(self) -> None:
        with self.lock:
            self.released.set()
        super().stop()


def through_proxy(backend, proxy: S3Proxy, **options):
    """``backend`` (an S3 :class:`~opd_testkit.stores.Backend`) reached through ``proxy``,
    with ``options`` added to its storage options."""
    import dataclasses

    return dataclasses.replace(backend, storage_options=dict(backend.storage_options, endpoint_url=proxy.endpoint_url,
                                                             **options))


__all__ = ["Request", "Rule", "S3FaultProxy", "S3Proxy", "through_proxy"]
