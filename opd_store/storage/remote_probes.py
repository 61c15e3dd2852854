"""Bucket stores: a bounded read probe, and the store's clock (the ``Date`` its server sends).

**The read probe** of a reachability check (:mod:`opd_store.storage.reachability`) is one listing
of the store's prefix (``MaxKeys=1``), sent with opd_store's own timeouts and at most one retry:

- S3: through a separate s3fs client built from the store's options with ``connect_timeout`` and
  ``read_timeout`` set to the check's bound, botocore's retry handler with two attempts in all,
  and s3fs's own retry loop (``S3FileSystem.retries``, 5 by default, around botocore's)
  set to one pass. With the clients' defaults a refused connection was retried for minutes.
- GCS: gcsfs retries every request six times with back-off fixed when its class is defined, so
  the probe is one ``GET .../b/<bucket>/o`` sent with ``requests`` (gcsfs's own dependency) to
  the endpoint gcsfs uses, with the credentials gcsfs found. gcsfs falls back to anonymous access
  when it finds no credentials at all; the probe refuses that unless the caller asked for it
  (``token="anon"``), so a machine without credentials gets "no credentials found" at once,
  not an HTTP 401 after the retries.

**The store's clock** is the ``Date`` header of a response from the server (S3 and GCS send one
on every response, RFC 9110: the time the response was generated), truncated to the second, so
the clock reads at most one second early: an age computed against it is never overstated.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from ..errors import StoreUnreachableError
from .reachability import missing_bucket
from .s3_session import share_data

if TYPE_CHECKING:
    from .base import Storage

logger = logging.getLogger("opd_store.storage")

GCS_CREDENTIAL_SOURCES = "GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server"
S3_CREDENTIAL_SOURCES = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws, instance role"


def bucket_and_prefix(storage: "Storage") -> tuple[str, str]:
    """The bucket of a bucket store and its key prefix (``""`` or ``"run/x/"``, ending in ``/``)."""
    bucket, _, prefix = storage.root.partition("/")
    return bucket, f"{prefix}/" if prefix else ""


def date_header_secs(value: str | None) -> float | None:
    """Seconds since the epoch of an HTTP ``Date`` header, or ``None`` when absent or malformed."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _server_clock(storage: "Storage", value: str | None) -> float:
    secs = date_header_secs(value)
    if secs is None:
        logger.warning("%s: the server sent no Date header; ages are measured on this machine's clock",
                       storage.url_root)
        return time.time()
    return secs


# -- S3 ------------------------------------------------------------------------------------------
def s3_probe_read(storage: "Storage", timeout_secs: float, stage: dict[str, str]) -> None:
    """List the store's prefix once with the check's timeouts and one retry (module docstring).

    Raises:
        StoreUnreachableError: the bucket does not exist.
        Exception: anything else the client raised (the check names the cause).
    """
    import s3fs

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
    return _server_clock(storage, ((out.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date"))


def s3_newest_part_secs(storage: "Storage", rel: str, upload_id: str) -> float | None:
    """The newest ``LastModified`` of the parts of one multipart upload (``ListParts``, paginated)."""
    bucket, prefix = bucket_and_prefix(storage)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": f"{prefix}{rel}", "UploadId": upload_id}
    newest: float | None = None
    while True:
        out = storage.fs.call_s3("list_parts", **kwargs)
        for part in out.get("Parts", []) or []:
            stamp = part["LastModified"].timestamp()
            newest = stamp if newest is None else max(newest, stamp)
        if not out.get("IsTruncated"):
            return newest
        kwargs["PartNumberMarker"] = out.get("NextPartNumberMarker")


# -- GCS -----------------------------------------------------------------------------------------
def gcs_probe_read(storage: "Storage", timeout_secs: float, stage: dict[str, str]) -> None:
    """Find credentials (gcsfs builds its client), then list the store's prefix with one request
    and one retry of a 429/5xx answer (module docstring).

    Raises:
        StoreUnreachableError: no credentials, a missing bucket, access denied, another HTTP error.
        Exception: a connection failure (the check names the cause).
    """
    import requests

    stage["operation"] = "find credentials"
    fs = storage.fs  # gcsfs looks for credentials while it is built
    credentials = fs.credentials
    if credentials.method == "anon" and credentials.token is None:
        raise StoreUnreachableError(
            f"{storage.url_root}: no credentials found ({GCS_CREDENTIAL_SOURCES}); for a public bucket "
            "or an emulator pass token=anon (--storage-option token=anon)")
    headers: dict[str, str] = {}
    credentials.apply(headers)  # refreshes an expired token first
    stage["operation"] = "list the store"
    bucket, prefix = bucket_and_prefix(storage)
    url = f"{fs.base}b/{quote(bucket, safe='')}/o"
    params = {"prefix": prefix, "delimiter": "/", "maxResults": "1"}
    for attempt in range(2):
        response = requests.get(url, params=params, headers=headers, timeout=(timeout_secs, timeout_secs))
        if attempt == 0 and (response.status_code == 429 or response.status_code >= 500):
            continue
        break
    if response.status_code == 404:
        raise StoreUnreachableError(f"{storage.url_root}: bucket {bucket!r} does not exist")
    if response.status_code >= 400:
        what = "access denied" if response.status_code in (401, 403) else "the server refused the listing"
        detail = (response.text.strip().splitlines() or [response.reason or ""])[0][:200]
        raise StoreUnreachableError(
            f"{storage.url_root}: cannot list the store: {what} (HTTP {response.status_code}: {detail})")


def gcs_clock_secs(storage: "Storage") -> float:
    """The GCS server's clock: the ``Date`` of a one-object listing of the store's prefix."""
    bucket, prefix = bucket_and_prefix(storage)
    headers, _contents = storage.fs.call("GET", "b/{}/o", bucket, prefix=prefix, maxResults=1)
    return _server_clock(storage, headers.get("Date"))


__all__ = [
    "GCS_CREDENTIAL_SOURCES",
    "S3_CREDENTIAL_SOURCES",
    "bucket_and_prefix",
    "date_header_secs",
    "gcs_clock_secs",
    "gcs_probe_read",
    "s3_clock_secs",
    "s3_newest_part_secs",
    "s3_probe_read",
]
