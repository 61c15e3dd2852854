"""S3: a bounded read probe and the server's clock.

The read probe of a reachability check (:mod:`opd_store.storage._reachability`) is one listing of
the store's prefix (``MaxKeys=1``) through a separate s3fs client built from the store's options
with ``connect_timeout`` and ``read_timeout`` set to the check's bound, botocore's retry handler
with two attempts in all, and s3fs's own retry loop (``S3FileSystem.retries``, 5 by default, around
botocore's) set to one pass. With the clients' defaults a refused connection was retried for
minutes. The clock is the ``Date`` header of a response (:func:`opd_store.storage._bucket.server_clock`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._bucket import bucket_and_prefix, server_clock
from .._reachability import Probe, missing_bucket
from ._session import share_data

if TYPE_CHECKING:
    from .._base import Storage

S3_CREDENTIAL_SOURCES = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws, instance role"


class S3Probe(Probe):
    """An S3 store's probe: a bounded read half (module docstring), the default write half."""

    def read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        """List the store's prefix once with the check's timeouts and one retry. Only requests
        inside the prefix (least privilege: deploy/iam/s3-policy.json grants s3:ListBucket only for
        the run's prefix; HeadBucket would be denied); the listing alone tells a missing bucket
        (NoSuchBucket) from an empty store (no keys).

        Raises:
            StoreUnreachableError: the bucket does not exist.
            Exception: anything else the client raised (the check names the cause).
        """
        import s3fs

        storage = self.storage
        stage["operation"] = "list the store"
        options: dict[str, Any] = dict(storage.fs.storage_options)
        options["config_kwargs"] = dict(options.get("config_kwargs") or {}, connect_timeout=timeout_secs,
                                        read_timeout=timeout_secs, retries={"mode": "legacy", "total_max_attempts": 2})
        options["skip_instance_cache"] = True
        probe = share_data(s3fs.S3FileSystem(**options))
        probe.retries = 1  # s3fs's retry loop around botocore's: a single pass
        bucket, prefix = bucket_and_prefix(storage)
        try:
            probe.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - a missing bucket is named; anything else propagates
            missing = missing_bucket(storage, exc)
            if missing is not None:
                raise missing from exc
            raise


def s3_clock_secs(storage: "Storage") -> float:
    """The S3 server's clock: the ``Date`` of a one-key listing of the store's prefix."""
    bucket, prefix = bucket_and_prefix(storage)
    out = storage.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
    return server_clock(storage, ((out.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date"))


__all__ = ["S3Probe", "S3_CREDENTIAL_SOURCES", "s3_clock_secs"]
