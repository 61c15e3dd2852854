"""A fake cloud metadata server on loopback: AWS IMDSv2 spot ``instance-action`` and GCE
``instance/preempted``, as their documentation describes them.

AWS: ``PUT /latest/api/token`` (needs ``X-aws-ec2-metadata-token-ttl-seconds``) returns a token;
``GET /latest/meta-data/spot/instance-action`` needs ``X-aws-ec2-metadata-token`` (401 without a
valid one) and answers 404 until :meth:`FakeMetadataServer.post_aws_notice`, then 200 with
``{"action": ..., "time": ...}``.

GCE: ``GET /computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor: Google`` (403 without)
and answers ``FALSE`` until :meth:`FakeMetadataServer.post_gce_notice`, then ``TRUE``; with
``?wait_for_change=true`` it holds the request until the value changes or ``timeout_sec`` passes.

Every request is recorded in :attr:`requests` as ``(method, path, status)``.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import threading
import urllib.parse


class FakeMetadataServer:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, int]] = []
        self.tokens: set[str] = set()
        self.aws_notice: dict | None = None
        self.gce_preempted = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: bytes = b"", content_type: str = "text/plain") -> None:
                with server.lock:
                    server.requests.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._answer(400)
                token = f"token-{len(server.tokens)}"
                server.tokens.add(token)
                return self._answer(200, token.encode())

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in server.tokens:
                        return self._answer(401)
                    if server.aws_notice is None:
                        return self._answer(404, b"Not Found")
                    return self._answer(200, json.dumps(server.aws_notice).encode(), "application/json")
                if url.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403)
                    query = urllib.parse.parse_qs(url.query)
                    if query.get("wait_for_change") == ["true"]:
                        server.gce_preempted.wait(float(query.get("timeout_sec", ["5"])[0]))
                    return self._answer(200, b"TRUE" if server.gce_preempted.is_set() else b"FALSE")
                return self._answer(404)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def post_aws_notice(self, action: str = "terminate", secs_ahead: float = 120.0) -> None:
        when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=secs_ahead)
        self.aws_notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def post_gce_notice(self) -> None:
        self.gce_preempted.set()

    def statuses(self, path_prefix: str) -> list[int]:
        with self.lock:
            return [status for _method, path, status in self.requests if path.startswith(path_prefix)]

    def stop(self) -> None:
        self.gce_preempted.set()  # release hanging GETs
        self._server.shutdown()
        self._server.server_close()
