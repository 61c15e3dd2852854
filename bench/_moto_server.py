"""moto's S3 server in its own process, with a request counter in front of it.

The benchmark client and the server must not share a GIL (on a 2-core machine a threaded moto in
the client process would bill the server's work to the code under test), so the server runs here:

    python -m bench._moto_server          # prints "PORT <n>" once listening, then serves

Besides moto's own endpoints (``/moto-api/reset``) it answers two of its own:

- ``GET /__bench__/requests``: JSON ``{"total": n, "by_kind": {"GET ListObjectsV2": n, ...}}``
  counting every S3 request since the last reset (the counter endpoints themselves excluded);
- ``POST /__bench__/requests/reset``: zero the counter.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import urllib.parse

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def s3_request_kind(method: str, query: str, path: str) -> str:
    """A short name of an S3 REST request from its method, query string and path."""
    keys = set(urllib.parse.parse_qs(query, keep_blank_values=True))
    key_part = path.strip("/").partition("/")[2]
    if method == "GET":
        if "list-type" in keys:
            return "ListObjectsV2"
        if "uploads" in keys:
            return "ListMultipartUploads"
        if not key_part:
            return "ListObjects(v1)"
        return "GetObject"
    if method == "HEAD":
        return "HeadObject" if key_part else "HeadBucket"
    if method == "PUT":
        if "partNumber" in keys:
            return "UploadPart"
        return "PutObject" if key_part else "CreateBucket"
    if method == "POST":
        if "uploads" in keys:
            return "CreateMultipartUpload"
        if "uploadId" in keys:
            return "CompleteMultipartUpload"
        if "delete" in keys:
            return "DeleteObjects"
        return "POST"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in keys else "DeleteObject"
    return method


class CountingMiddleware:
    """WSGI middleware counting requests by kind; serves the counter endpoints."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__bench__/requests"):
            with self.lock:
                if path.endswith("/reset"):
                    self.counts.clear()
                body = json.dumps({"total": sum(self.counts.values()), "by_kind": dict(self.counts)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if not path.startswith("/moto-api"):
            kind = s3_request_kind(environ.get("REQUEST_METHOD", ""), environ.get("QUERY_STRING", ""), path)
            with self.lock:
                self.counts[f"{environ.get('REQUEST_METHOD', '')} {kind}"] += 1
        return self.app(environ, start_response)


def _exit_with_parent() -> None:
    """Stop serving when the process that started us is gone (no orphaned servers after a crash)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(2)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    _exit_with_parent()

    app = CountingMiddleware(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
