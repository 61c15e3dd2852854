"""Amazon S3 (or an S3-compatible server) through s3fs: :class:`S3Storage`.

The manifest is one ``PutObject`` with ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``);
it is far below s3fs's multipart threshold, so it is never a multipart upload (moto does not enforce
conditions on ``CompleteMultipartUpload``; field notes).
"""

from __future__ import annotations

import os
from typing import BinaryIO

from .._bucket import BucketStorage
from . import _probes
from ._uploads import S3Uploads


class S3Storage(BucketStorage):
    """Amazon S3 (or an S3-compatible server) through s3fs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.s3._multipart`) as multipart parts
    of ``part_size_bytes``, up to ``parts_in_flight`` at once (``transfers.settings``) across the
    store's payloads; reads (:mod:`opd_store.storage.s3._reads`) as parallel ranged GETs into one
    buffer; streaming reads for copies (:mod:`opd_store.storage.transfers._range_stream`) as parallel ranged
    GETs into ``parts_in_flight`` reused part buffers, handed out in order. Its unfinished
    multipart uploads are :mod:`opd_store.storage.s3._uploads`.
    """

    commit_primitive = "single PutObject with If-None-Match: * (412 when the key exists)"
    credential_sources = _probes.S3_CREDENTIAL_SOURCES
    counts_own_requests = True

    @classmethod
    def with_client_timeouts(cls, options, timeouts):
        from ._client import client_options

        return client_options(options, timeouts)

    @property
    def endpoint(self) -> str | None:
        """The configured endpoint (``endpoint_url``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``),
        or ``None`` for AWS's own (botocore's errors then name the endpoint they tried)."""
        options = self.client_options
        return (options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))

    def count_client_requests(self, fs) -> None:
        """Count every S3 API call by its kind: s3fs's ``_call_s3`` is where s3fs (every page of a
        listing included) and opd_store's multipart uploads and ranged reads send theirs."""
        from .._request_tally import count_calls

        count_calls(fs, "_call_s3", s3_request_kind, self.requests)

    def reachability_probe(self) -> _probes.S3Probe:
        return _probes.S3Probe(self)

    def multipart_uploads(self) -> S3Uploads:
        return S3Uploads(self)

    def clock_secs(self) -> float:
        return _probes.s3_clock_secs(self)

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

    def _bucket_and_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def open_write(self, rel: str) -> BinaryIO:
        from ..transfers import PartWriter
        from ._multipart import S3Multipart

        bucket, key = self._bucket_and_key(rel)
        upload = S3Multipart(self.fs, bucket, key, self.url(rel), send_timeout_secs=self.timeouts.read_timeout_secs,
                             pacer=self.transfers.pacer)
        return PartWriter(upload, self.transfers.part_pool)  # type: ignore[return-value]

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from ._reads import read_checked

        bucket, key = self._bucket_and_key(rel)
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers.settings,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes))

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        from ._reads import range_opener

        return self._range_stream(rel, size_bytes, range_opener)


_S3_KINDS = {
    "list_objects_v2": "list", "list_objects": "list", "list_multipart_uploads": "list", "list_parts": "list",
    "list_object_versions": "list", "head_object": "head", "head_bucket": "head", "get_object": "get",
    "put_object": "put", "upload_part": "put", "copy_object": "put", "upload_part_copy": "put",
    "create_multipart_upload": "post", "complete_multipart_upload": "post", "delete_object": "delete",
    "delete_objects": "delete", "abort_multipart_upload": "delete",
}


def s3_request_kind(method: str, *args, **kwargs) -> str:
    """The kind (:mod:`opd_store.storage._request_tally`) of one s3fs ``_call_s3`` (botocore's
    method name); any other call counts as a ``get`` (AWS bills it among GET and others)."""
    return _S3_KINDS.get(getattr(method, "__name__", method), "get")


__all__ = ["S3Storage"]
