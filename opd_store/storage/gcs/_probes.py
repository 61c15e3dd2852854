"""GCS: a bounded read probe and the server's clock.

gcsfs retries every request six times with back-off fixed when its class is defined, so the read
probe of a reachability check (:mod:`opd_store.storage._reachability`) is one
``GET .../b/<bucket>/o`` sent with ``requests`` (gcsfs's own dependency) to the endpoint gcsfs
uses, with the credentials gcsfs found. gcsfs falls back to anonymous access when it finds no
credentials at all; the probe refuses that unless the caller asked for it (``token="anon"``), so a
machine without credentials gets "no credentials found" at once, not an HTTP 401 after the
retries. The clock is the ``Date`` header of a response (:func:`opd_store.storage._bucket.server_clock`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from ...errors import StoreUnreachableError
from .._bucket import bucket_and_prefix, server_clock
from .._reachability import Probe

if TYPE_CHECKING:
    from .._base import Storage

GCS_CREDENTIAL_SOURCES = "GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server"


class GCSProbe(Probe):
    """A GCS store's probe: a bounded read half (module docstring), the default write half."""

    def read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        """Find credentials (gcsfs builds its client), then list the store's prefix with one
        request and one retry of a 429/5xx answer.

        Raises:
            StoreUnreachableError: no credentials, a missing bucket, access denied, another HTTP error.
            Exception: a connection failure (the check names the cause).
        """
        import requests

        storage = self.storage
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
    return server_clock(storage, headers.get("Date"))


__all__ = ["GCSProbe", "GCS_CREDENTIAL_SOURCES", "gcs_clock_secs"]
