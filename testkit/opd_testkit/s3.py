"""moto's S3 server on loopback for tests, benchmarks and ``opd-store demo --s3-emulator``.

* :class:`MotoS3`: moto in a thread of this process (tests), behind :class:`S3FirstDispatcher`.
* :class:`MotoProcess`: moto in a process of its own (``python -m opd_testkit.s3``), so a
  benchmark's client and the server do not share a GIL; it counts requests by S3 operation
  (:class:`CountingMiddleware`, read with :meth:`MotoProcess.requests`).
* :func:`s3_operation`: the S3 API operation of a request, from method, path and query (used by
  the counters here and by the proxies of :mod:`opd_testkit.proxies`).
* :class:`S3RequestCounter`: counts the requests an s3fs client sends (botocore ``before-send``).

Both servers listen on 127.0.0.1 on a port the OS chooses. moto, boto3 and werkzeug are imported
only when a server starts (the ``job`` and ``test`` extras install them).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Any
from urllib.parse import parse_qs

from opd_store.job._machines import end_process, process_cpu_secs

from .stores import EMULATOR_ENV, Backend

# -- requests -------------------------------------------------------------------------------------


def s3_operation(method: str, path: str, query: str) -> str:
    """The S3 API operation of a path-style request (``/bucket/key?query``): ``PutObject``,
    ``UploadPart``, ``ListObjectsV2``, ``GetBucketLocation``, ... (the HTTP method when unknown)."""
    params = parse_qs(query, keep_blank_values=True)
    parts = path.lstrip("/").split("/", 1)
    has_key = len(parts) == 2 and parts[1] != ""
    if method == "PUT":
        if "partNumber" in params and "uploadId" in params:
            return "UploadPart"
        if not has_key:
            return "CreateBucket"
        return "PutObject"
    if method == "POST":
        if "uploads" in params:
            return "CreateMultipartUpload"
        if "uploadId" in params:
            return "CompleteMultipartUpload"
        if "delete" in params:
            return "DeleteObjects"
        return "POST"
    if method == "DELETE":
        if "uploadId" in params:
            return "AbortMultipartUpload"
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if has_key:
            return "ListParts" if "uploadId" in params else "GetObject"
        if "uploads" in params:
            return "ListMultipartUploads"
        if "list-type" in params:
            return "ListObjectsV2"
        for name in ("location", "versioning", "acl", "policy"):
            if name in params:
                return "GetBucket" + name.title()
        return "ListObjects"
    return method


class S3RequestCounter:
    """Counts requests a botocore client sends (``before-send.s3``: once per HTTP attempt, retries
    included), in all (:attr:`total`) and by operation name (:attr:`by_op`)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_op: dict[str, int] = {}

    def __call__(self, request=None, **kwargs) -> None:  # noqa: ANN001 - botocore event signature
        self.total += 1
        name = kwargs.get("event_name", "")
        op = getattr(request, "context", {}).get("operation_name") if request is not None else None
        op = op or name.rpartition(".")[2]
        self.by_op[op] = self.by_op.get(op, 0) + 1

    def reset(self) -> None:
        self.total = 0
        self.by_op = {}

    def attach(self, fs) -> None:
        """Register on an s3fs filesystem's (aio)botocore client, creating the client first."""
        fs.connect()
        fs.s3.meta.events.register("before-send.s3", self)


class CountingMiddleware:
    """WSGI middleware in front of moto counting S3 requests by ``"METHOD Operation"``.

    Serves ``GET /__requests__`` (JSON ``{"total": n, "by_kind": {"GET ListObjectsV2": n, ...}}``
    since the last reset; moto's own ``/moto-api`` endpoints are not counted) and
    ``POST /__requests__/reset``.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__requests__"):
            with self.lock:
                if path.endswith("/reset"):
                    self.counts.clear()
                body = json.dumps({"total": sum(self.counts.values()), "by_kind": dict(self.counts)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if not path.startswith("/moto-api"):
            method = environ.get("REQUEST_METHOD", "")
            kind = s3_operation(method, path, environ.get("QUERY_STRING", ""))
            with self.lock:
                self.counts[f"{method} {kind}"] += 1
        return self.app(environ, start_response)


_CREDENTIAL_SCOPE = re.compile(r"Credential=[^/,&\s]+/\d{8}/[^/]+/([^/]+)/aws4_request")


class S3FirstDispatcher:
    """moto's WSGI application, with requests signed for S3 sent straight to moto's S3 app.

    moto's ``DomainDispatcherApplication`` finds each request's service by listing its ~180 service
    folders on disk, twice per request (``moto.backends.list_of_moto_modules``: 70,000 ``stat``
    calls per 400 S3 requests, 40% of moto's CPU per request here). A SigV4 credential scope
    (``Authorization`` header or a presigned URL's ``X-Amz-Credential``) naming ``s3`` needs none
    of that; every other request (``/moto-api``, IAM, unsigned) goes through moto's dispatcher,
    which shares the same S3 app.
    """

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        self.dispatcher = DomainDispatcherApplication(create_backend_app)
        self.s3_app = self.dispatcher.app_instances["s3"] = create_backend_app("s3")

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        signed = environ.get("HTTP_AUTHORIZATION", "") or urllib.parse.unquote(environ.get("QUERY_STRING", ""))
        scope = _CREDENTIAL_SCOPE.search(signed)
        if scope is not None and scope.group(1) == "s3" and not path.startswith("/moto-api"):
            return self.s3_app(environ, start_response)
        return self.dispatcher(environ, start_response)


def _wsgi_server(app):
    """A threaded werkzeug server for ``app`` on 127.0.0.1, port chosen by the OS, with moto's
    request handler and a backlog for hundreds of clients at once (werkzeug's 128 drops SYNs)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    server.socket.listen(4096)
    return server


# -- a server in this process ---------------------------------------------------------------------


def _client(endpoint_url: str, max_pool_connections: int = 10):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=EMULATOR_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=EMULATOR_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=EMULATOR_ENV["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=max_pool_connections),
    )


class S3Endpoint:
    """What every S3 server here offers (moto in a thread or a process, SeaweedFS): the endpoint, options for s3fs, a boto3 client, buckets, reset."""

    endpoint_url: str

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (the emulator credentials)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": EMULATOR_ENV["AWS_ACCESS_KEY_ID"],
            "secret": EMULATOR_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": EMULATOR_ENV["AWS_DEFAULT_REGION"]},
        }

    def environment(self) -> dict[str, str]:
        """Environment variables a child process needs to reach this server with botocore."""
        return {key: value for key, value in EMULATOR_ENV.items() if key.startswith("AWS_")}

    def boto3_client(self, max_pool_connections: int = 10):
        return _client(self.endpoint_url, max_pool_connections)

    def create_bucket(self, bucket: str) -> None:
        self.boto3_client().create_bucket(Bucket=bucket)

    def _post(self, path: str) -> bytes:
        request = urllib.request.Request(f"{self.endpoint_url}{path}", method="POST", data=b"")
        return urllib.request.urlopen(request, timeout=120).read()

    def reset(self) -> None:
        """Delete every bucket and object (moto's ``/moto-api/reset``)."""
        self._post("/moto-api/reset")


class MotoS3(S3Endpoint):
    """moto (:class:`S3FirstDispatcher`) on 127.0.0.1 in a thread of this process, port chosen by
    the OS."""

    def __init__(self) -> None:
        import logging

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request log lines
        self._server = _wsgi_server(S3FirstDispatcher())
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._client = None

    def boto3_client(self, max_pool_connections: int = 10):
        if max_pool_connections != 10:
            return _client(self.endpoint_url, max_pool_connections)
        if self._client is None:  # one client per server: moto's reset keeps the endpoint
            self._client = _client(self.endpoint_url)
        return self._client

    def new_backend(self, bucket: str = "opd-test") -> Backend:
        """Reset the server and create ``bucket``: a clean S3 location ``s3://bucket/runs/demo``."""
        self.reset()
        self.create_bucket(bucket)
        return Backend("s3", f"s3://{bucket}/runs/demo", self.storage_options(), server="moto")

    def smoke_check(self) -> dict[str, Any]:
        """Prove s3fs talks to this server over HTTP: list, write, read, multipart, delete.

        Returns:
            dict: what was observed (``listed``, ``read_back``, ``multipart_etag``, ``parts``,
            ``after_delete``).

        Raises:
            RuntimeError: a step did not behave as S3 does, naming the step.
        """
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        client = self.boto3_client()
        bucket = "opd-smoke"
        seen: dict[str, Any] = {}

        def require(ok: bool, step: str) -> None:
            if not ok:
                raise RuntimeError(f"moto smoke test failed at {step!r} against {self.endpoint_url}: {seen}")

        client.create_bucket(Bucket=bucket)
        fs.pipe_file(f"{bucket}/smoke/small.bin", b"opd-store smoke")
        seen["listed"] = sorted(fs.ls(f"{bucket}/smoke", detail=False, refresh=True))
        require(seen["listed"] == [f"{bucket}/smoke/small.bin"], "list")
        seen["read_back"] = fs.cat_file(f"{bucket}/smoke/small.bin")
        require(seen["read_back"] == b"opd-store smoke", "read")
        part = 5 << 20  # S3's smallest multipart part
        data = bytes(range(256)) * ((2 * part + 1024) // 256)
        with fs.open(f"{bucket}/smoke/multipart.bin", "wb", block_size=part) as handle:
            for offset in range(0, len(data), part):  # one block per write: one part each
                handle.write(data[offset:offset + part])
        head = client.head_object(Bucket=bucket, Key="smoke/multipart.bin")
        seen["multipart_etag"] = head["ETag"]
        seen["parts"] = int(head["ETag"].strip('"').rpartition("-")[2] or 0) if "-" in head["ETag"] else 0
        require(seen["parts"] >= 2 and head["ContentLength"] == len(data), "multipart write")
        require(fs.cat_file(f"{bucket}/smoke/multipart.bin") == data, "multipart read")
        require(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == [], "multipart completion")
        fs.rm(f"{bucket}/smoke", recursive=True)
        fs.invalidate_cache()
        seen["after_delete"] = client.list_objects_v2(Bucket=bucket).get("KeyCount")
        require(seen["after_delete"] == 0 and not fs.exists(f"{bucket}/smoke/small.bin"), "delete")
        client.delete_bucket(Bucket=bucket)
        return seen

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


# -- a server in its own process ------------------------------------------------------------------


class MotoProcess(S3Endpoint):
    """moto in its own process (``python -m opd_testkit.s3``) with :class:`CountingMiddleware`.

    Args:
        key_buffer_bytes (int | None): moto keeps each object in a ``SpooledTemporaryFile`` that
            spills to disk above ~5 MiB by default; benchmarks keep objects in memory up to this
            size so disk noise stays out of S3 runs (``None``: moto's default).
    """

    def __init__(self, key_buffer_bytes: int | None = 4 * 2**30) -> None:
        env = dict(os.environ, **self.environment())
        if key_buffer_bytes:
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(key_buffer_bytes)
        self._log = open(os.devnull, "wb")  # noqa: SIM115
        self.process = subprocess.Popen([sys.executable, "-m", "opd_testkit.s3"], env=env,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.process.kill()
            raise RuntimeError(f"moto server did not start: {line!r}")
        self.endpoint_url = f"http://127.0.0.1:{int(line.split()[1])}"
        self.pid = self.process.pid

    def storage_options(self) -> dict[str, Any]:
        options = super().storage_options()
        # moto completes a 1 GiB multipart upload slowly on a busy 2-core machine; botocore's
        # default 60 s read timeout then retries a completion moto already consumed (500).
        options["config_kwargs"] = {"read_timeout": 1800, "connect_timeout": 60}
        return options

    def requests(self) -> dict[str, Any]:
        """``{"total": n, "by_kind": {"GET ListObjectsV2": n, ...}}`` since the last reset."""
        return json.loads(urllib.request.urlopen(f"{self.endpoint_url}/__requests__", timeout=30).read())

    def reset_requests(self) -> None:
        self._post("/__requests__/reset")

    def new_bucket(self, bucket: str) -> None:
        self.create_bucket(bucket)

    def cpu_secs(self) -> float:
        """CPU seconds (user + system) the moto process has used so far."""
        return process_cpu_secs(self.pid)

    def stop(self) -> None:
        end_process(self.process, 15)
        self.process.stdout.close()
        self._log.close()


def _exit_with_parent() -> None:
    """Stop serving when the process that started us is gone (no orphaned servers after a crash)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)  # polling the parent's liveness, not synchronising with it
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve() -> None:
    """``python -m opd_testkit.s3``: serve moto with :class:`CountingMiddleware` on
    127.0.0.1; prints ``PORT <n>`` once listening."""
    _exit_with_parent()
    server = _wsgi_server(CountingMiddleware(S3FirstDispatcher()))
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


__all__ = [
    "CountingMiddleware", "MotoProcess", "MotoS3", "S3Endpoint", "S3FirstDispatcher", "S3RequestCounter", "s3_operation",
    "serve",
]

if __name__ == "__main__":
    serve()
