"""S3's unfinished multipart uploads under a store's prefix: the capability
:meth:`S3Storage.multipart_uploads <opd_store.storage.s3._storage.S3Storage.multipart_uploads>` offers.

``ListMultipartUploads`` is asked with the store's key prefix (s3fs's ``list_multipart_uploads``
lists the whole bucket and drops pagination), on a key boundary only; the age of an upload's parts
is ``ListParts`` (paginated). Failures to reach the store are translated like every verb's
(:func:`opd_store.storage._fsspec.translated`).
"""

from __future__ import annotations

from typing import Any

from .._base import MultipartUploads
from .._bucket import BucketStorage, bucket_and_prefix
from .._fsspec import translated


class S3Uploads(MultipartUploads):
    """The multipart uploads under one S3 store's root (see :class:`~opd_store.storage._base.MultipartUploads`).

    Args:
        storage (BucketStorage): the S3 store; its s3fs client sends the requests.
    """

    def __init__(self, storage: BucketStorage) -> None:
        self.storage = storage

    def list(self) -> list[tuple[str, str, float]]:
        return translated(self.storage, "", "list its multipart uploads", self._list)

    def abort(self, rel: str, upload_id: str) -> None:
        bucket, prefix = bucket_and_prefix(self.storage)
        translated(self.storage, rel, "abort an upload under it", lambda: self.storage.fs.call_s3(
            "abort_multipart_upload", Bucket=bucket, Key=f"{prefix}{rel}", UploadId=upload_id))

    def newest_part_secs(self, rel: str, upload_id: str) -> float | None:
        return translated(self.storage, rel, "list the parts of an upload under it",
                          lambda: self._newest_part_secs(rel, upload_id))

    def _list(self) -> list[tuple[str, str, float]]:
        bucket, key_prefix = bucket_and_prefix(self.storage)
        found: list[tuple[str, str, float]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        while True:
            out = self.storage.fs.call_s3("list_multipart_uploads", **kwargs)
            for upload in out.get("Uploads", []) or []:
                key = upload["Key"]
                if key.startswith(key_prefix):
                    found.append((key[len(key_prefix):], upload["UploadId"], upload["Initiated"].timestamp()))
            if not out.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = out.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker")

    def _newest_part_secs(self, rel: str, upload_id: str) -> float | None:
        bucket, prefix = bucket_and_prefix(self.storage)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": f"{prefix}{rel}", "UploadId": upload_id}
        newest: float | None = None
        while True:
            out = self.storage.fs.call_s3("list_parts", **kwargs)
            for part in out.get("Parts", []) or []:
                stamp = part["LastModified"].timestamp()
                newest = stamp if newest is None else max(newest, stamp)
            if not out.get("IsTruncated"):
                return newest
            kwargs["PartNumberMarker"] = out.get("NextPartNumberMarker")


__all__ = ["S3Uploads"]
