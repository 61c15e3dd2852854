"""Object-store backends: S3 (s3fs) and GCS (gcsfs), their create-only write, probes, clocks and
parallel transfers.

How each makes the manifest create-only (the commit point; the other backends are in
:mod:`opd_store.storage.backends`):

=========  ===================================================================================
s3         one ``PutObject`` with ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``); the
           manifest is far below s3fs's multipart threshold, so it is never a multipart upload
           (moto does not enforce conditions on ``CompleteMultipartUpload``; field notes).
gs         one single-request upload with ``ifGenerationMatch=0`` (gcsfs ``pipe_file(mode=
           "create")`` below its chunk size; fake-gcs-server ignores preconditions on resumable
           uploads, field notes).
=========  ===================================================================================

Payloads move over several connections: uploads through
:mod:`opd_store.storage.s3_transfers`/:mod:`opd_store.storage.gcs_transfers`, reads through
:mod:`opd_store.storage.s3_reads`/:mod:`opd_store.storage.gcs_reads` and, for copies,
:mod:`opd_store.storage.range_stream`.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from . import remote_probes
from .fsspec_storage import FsspecStorage, NoMultipartUploads


class BucketStorage(FsspecStorage):
    """An object store whose fsspec ``pipe_file(mode="create")`` is one conditional request."""

    atomic_create = True
    bucketed = True

    def create_exclusive(self, rel: str, data: bytes) -> None:
        # Small data only (a manifest): both s3fs and gcsfs send it as one request, to which the
        # precondition applies; above their chunk sizes they would switch to multipart/resumable.
        self.fs.pipe_file(self.path(rel), data, mode="create")
        self.refresh()

    def _range_stream(self, rel: str, size_bytes: int, range_opener) -> BinaryIO:
        """:meth:`open_read_stream` over the backend's ``range_opener(fs, bucket, key)``: ranges in
        flight into the read pool's buffers (:mod:`opd_store.storage.range_stream`); an empty
        object is one plain stream (its size checked by the caller)."""
        if not size_bytes:
            return self.open_read(rel)
        from .range_stream import RangeStream, range_fetcher

        bucket, _, key = self.path(rel).partition("/")
        url = self.url(rel)
        return RangeStream(self.fs.loop, range_fetcher(range_opener(self.fs, bucket, key), url, size_bytes), url,  # type: ignore[return-value]
                           size_bytes, self.read_pool(), self.transfers.parts_in_flight,
                           translate=lambda exc: self.unreachable_error(rel, "read", exc))

    # Payload writers are parallel part writers (opd_store.storage.part_writer): publishing runs in
    # the background, discarding removes what was uploaded.
    def start_finish(self, handle, rel: str):
        return handle.finish()

    def abort_write(self, handle, rel: str) -> None:
        handle.discard()

    def _expected_size(self, rel: str, size_bytes: int | None) -> int:
        """``size_bytes``, or the object's size asked of the store when the caller has none.

        Raises:
            FileNotFoundError: no such object.
        """
        if size_bytes is None:
            size_bytes = self.size(rel)
            if size_bytes is None:
                raise FileNotFoundError(f"{self.url(rel)}: no such object")
        return size_bytes


class S3Storage(BucketStorage):
    """Amazon S3 (or an S3-compatible server) through s3fs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.s3_transfers`) as multipart parts
    of ``transfers.part_size_bytes``, up to ``transfers.parts_in_flight`` at once across the
    store's payloads; reads (:mod:`opd_store.storage.s3_reads`) as parallel ranged GETs into one
    buffer; streaming reads for copies (:mod:`opd_store.storage.range_stream`) as parallel ranged
    GETs into ``parts_in_flight`` reused part buffers, handed out in order.
    """

    commit_primitive = "single PutObject with If-None-Match: * (412 when the key exists)"
    credential_sources = remote_probes.S3_CREDENTIAL_SOURCES

    @property
    def endpoint(self) -> str | None:
        """The configured endpoint (``endpoint_url``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``),
        or ``None`` for AWS's own (botocore's errors then name the endpoint they tried)."""
        options = self.client_options
        return (options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))

    def probe_read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        # Only requests inside the store's prefix (least privilege: deploy/iam/s3-policy.json
        # grants s3:ListBucket only for the run's prefix; HeadBucket would be denied). The prefix
        # listing alone tells a missing bucket (NoSuchBucket) from an empty store (no keys).
        remote_probes.s3_probe_read(self, timeout_secs, stage)

    def clock_secs(self) -> float:
        return remote_probes.s3_clock_secs(self)

    def newest_part_secs(self, rel: str, upload_id: str) -> float | None:
        return remote_probes.s3_newest_part_secs(self, rel, upload_id)

    def _list_dir(self, base: str) -> list[dict]:
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._lsdir, base, refresh=True)

    def _find_tree(self, base: str) -> dict[str, dict]:
        """Every object under ``base`` in one recursive listing, and no other request.

        s3fs's ``find`` of a prefix with nothing under it asks ``HeadObject`` of the prefix's own
        name (is it a file?): one more round trip on every empty store, and a request that needs
        ``s3:GetObject`` on the prefix itself, which a run's IAM policy scoped to ``prefix/*``
        denies. Listing the parent with ``<leaf>/`` as s3fs's ``prefix`` filter lists the same
        objects and never asks ``HeadObject``.
        """
        parent, _, leaf = base.rstrip("/").rpartition("/")
        if not parent:  # the bucket itself: s3fs asks nothing more for an empty key
            return self.fs.find(base, detail=True)
        return self.fs.find(parent, prefix=leaf + "/", detail=True)

    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        self.refresh()
        if max_bytes is not None:  # one ranged GET (no HEAD: the range is absolute)
            return self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        if small:
            # s3fs's cat_file sends a HEAD first to plan a concurrent ranged download; a manifest
            # is one GET.
            return self.fs.cat_file(self.path(rel), max_concurrency=1)
        return self.fs.cat_file(self.path(rel))

    def _bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.root.partition("/")
        return bucket, prefix

    def _bucket_and_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def open_write(self, rel: str) -> BinaryIO:
        from .part_writer import PartWriter
        from .s3_transfers import S3Multipart

        bucket, key = self._bucket_and_key(rel)
        upload = S3Multipart(self.fs, bucket, key, self.url(rel), send_timeout_secs=self.timeouts.read_timeout_secs)
        return PartWriter(upload, self.part_pool())  # type: ignore[return-value]

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from .s3_reads import read_checked

        bucket, key = self._bucket_and_key(rel)
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes))

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        from .s3_reads import range_opener

        return self._range_stream(rel, size_bytes, range_opener)

    def list_uploads(self) -> list[tuple[str, str, float]]:
        # ListMultipartUploads with the store's prefix (s3fs's list_multipart_uploads lists the
        # whole bucket and drops pagination); a prefix on a key boundary only.
        bucket, prefix = self._bucket_and_prefix()
        key_prefix = f"{prefix}/" if prefix else ""
        found: list[tuple[str, str, float]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        while True:
            out = self.fs.call_s3("list_multipart_uploads", **kwargs)
            for upload in out.get("Uploads", []) or []:
                key = upload["Key"]
                if key.startswith(key_prefix):
                    found.append((key[len(key_prefix):], upload["UploadId"], upload["Initiated"].timestamp()))
            if not out.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = out.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker")

    def abort_upload(self, rel: str, upload_id: str) -> None:
        bucket, prefix = self._bucket_and_prefix()
        key = f"{prefix}/{rel}" if prefix else rel
        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)


class GCSStorage(NoMultipartUploads, BucketStorage):
    """Google Cloud Storage through gcsfs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.gcs_transfers`) as parallel
    composite uploads (temporary part objects of ``transfers.part_size_bytes``, up to
    ``transfers.parts_in_flight`` at once across the store's payloads, composed into the payload and
    deleted before it is reported published); reads (:mod:`opd_store.storage.gcs_reads`) as parallel
    ranged downloads into one buffer. No upload is left open to list: a failed payload's temporary
    objects are deleted, and any a killed writer left lie in its uncommitted attempt, which ``gc``
    removes.
    """

    commit_primitive = "single-request upload with ifGenerationMatch=0 (412 when the object exists)"
    credential_sources = remote_probes.GCS_CREDENTIAL_SOURCES

    @property
    def endpoint(self) -> str:
        """The endpoint gcsfs talks to (``endpoint_url``, ``STORAGE_EMULATOR_HOST``, or Google's),
        without building the client."""
        location = self.client_options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "")
        if location in ("", "default"):
            return "https://storage.googleapis.com"
        return location if location.startswith(("http://", "https://")) else f"http://{location}"

    def probe_read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        remote_probes.gcs_probe_read(self, timeout_secs, stage)

    def clock_secs(self) -> float:
        return remote_probes.gcs_clock_secs(self)

    def open_write(self, rel: str) -> BinaryIO:
        from .gcs_transfers import GCSComposite
        from .part_writer import PartWriter

        bucket, _, key = self.path(rel).partition("/")
        upload = GCSComposite(self.fs, bucket, key, self.url(rel), send_timeout_secs=self.timeouts.read_timeout_secs)
        return PartWriter(upload, self.part_pool())  # type: ignore[return-value]

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        from .gcs_reads import range_opener

        return self._range_stream(rel, size_bytes, range_opener)

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from .gcs_reads import read_checked

        bucket, _, key = self.path(rel).partition("/")
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes))


__all__ = ["BucketStorage", "GCSStorage", "S3Storage"]
