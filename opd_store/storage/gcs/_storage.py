"""Google Cloud Storage through gcsfs: :class:`GCSStorage`.

The manifest is one single-request upload with ``ifGenerationMatch=0`` (gcsfs ``pipe_file(mode=
"create")`` below its chunk size; fake-gcs-server ignores preconditions on resumable uploads,
field notes).
"""

from __future__ import annotations

import os
from typing import BinaryIO

from .._bucket import BucketStorage
from . import _probes


class GCSStorage(BucketStorage):
    """Google Cloud Storage through gcsfs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.gcs._composite`) as parallel
    composite uploads (temporary part objects of ``part_size_bytes``, up to
    ``parts_in_flight`` at once across the store's payloads, composed into the payload and
    deleted before it is reported published); reads (:mod:`opd_store.storage.gcs._reads`) as parallel
    ranged downloads into one buffer. No upload is left open to list (no
    :meth:`~opd_store.storage._base.Storage.multipart_uploads`): a failed payload's temporary
    objects are deleted, and any a killed writer left lie in its uncommitted attempt, which ``gc``
    removes.
    """

    commit_primitive = "single-request upload with ifGenerationMatch=0 (412 when the object exists)"
    credential_sources = _probes.GCS_CREDENTIAL_SOURCES
    counts_own_requests = True

    @classmethod
    def with_client_timeouts(cls, options, timeouts):
        if "requests_timeout" in options:
            return options, timeouts, lambda fs: None
        import aiohttp

        # gcsfs hands requests_timeout to aiohttp as each request's timeout: a connect bound and a
        # bound on the wait for the next bytes, never on a whole (large) transfer (gcsfs's own
        # requests have no timeout at all).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_timeout_secs,
                                        sock_read=timeouts.read_timeout_secs)
        return dict(options, requests_timeout=timeout), timeouts, lambda fs: None

    @property
    def endpoint(self) -> str:
        """The endpoint gcsfs talks to (``endpoint_url``, ``STORAGE_EMULATOR_HOST``, or Google's),
        without building the client."""
        location = self.client_options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "")
        if location in ("", "default"):
            return "https://storage.googleapis.com"
        return location if location.startswith(("http://", "https://")) else f"http://{location}"

    def count_client_requests(self, fs) -> None:
        """Count every request of gcsfs's ``_request`` (where gcsfs and opd_store's composite
        uploads send theirs) by its kind; the ranged reads count their own (:mod:`._reads`)."""
        from .._request_tally import count_calls

        count_calls(fs, "_request", gcs_request_kind, self.requests)

    def reachability_probe(self) -> _probes.GCSProbe:
        return _probes.GCSProbe(self)

    def clock_secs(self) -> float:
        return _probes.gcs_clock_secs(self)

    def open_write(self, rel: str) -> BinaryIO:
        from ..transfers import PartWriter
        from ._composite import GCSComposite

        bucket, _, key = self.path(rel).partition("/")
        upload = GCSComposite(self.fs, bucket, key, self.url(rel), send_timeout_secs=self.timeouts.read_timeout_secs,
                              pacer=self.transfers.pacer)
        return PartWriter(upload, self.transfers.part_pool)  # type: ignore[return-value]

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        import functools

        from ._reads import range_opener

        return self._range_stream(rel, size_bytes, functools.partial(range_opener, requests=self.requests))

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from ._reads import read_checked

        bucket, _, key = self.path(rel).partition("/")
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers.settings,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes), requests=self.requests)


def gcs_request_kind(method: str, path: str, *args, **kwargs) -> str:
    """The kind (:mod:`opd_store.storage._request_tally`) of one gcsfs ``_request``: a listing
    (``GET b/{bucket}/o``), an object's metadata or bytes (``alt=media``), an upload (``POST``
    to the upload endpoint, ``PUT`` of a resumable chunk), a compose (``POST .../compose``), a delete."""
    method = method.upper()
    if method == "DELETE":
        return "delete"
    if method == "GET":
        if str(path).rstrip("/").endswith("/o"):
            return "list"
        return "get" if kwargs.get("alt") == "media" or "alt=media" in str(path) else "head"
    if method == "POST" and str(path).endswith("/compose"):
        return "post"
    return "put"


__all__ = ["GCSStorage"]
