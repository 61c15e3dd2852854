"""Amazon S3 and S3-compatible servers through s3fs: the backend, its multipart uploads, ranged
reads, probes and per-store botocore sessions (:func:`share_data`)."""

from ._session import share_data
from ._storage import S3Storage

__all__ = ["S3Storage", "share_data"]
