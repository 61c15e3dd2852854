"""Objects whose age on the *store's* clock a test controls, without sleeping.

Garbage collection measures an attempt's age by the modification times the backend records
against the backend's own notion of now (``opd_store.retention._gc``), so a test that needs an attempt
abandoned two hours ago must make the backend record it so:

- local files: their mtime is set explicitly (``os.utime``);
- S3 on moto: the moto server runs in the test process (:class:`~opd_testkit.s3.MotoS3`,
  in a thread), and moto stamps every object and part with
  ``moto.s3.models.utcnow()``; :func:`moto_clock` shifts that function,
  so objects written (or copied onto themselves, :func:`backdate`) meanwhile carry the shifted
  ``LastModified``. The ``Date`` header moto sends stays the real time, as a server's would.

fake-gcs-server is a separate binary whose clock cannot be shifted: these helpers are for local
and S3 stores.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .stores import Backend

if TYPE_CHECKING:
    from .s3 import MotoS3


@contextlib.contextmanager
def moto_clock(offset_secs: float) -> Iterator[None]:
    """While active, moto (in this process) stamps new objects and parts ``offset_secs`` away from
    the real time (negative: in the past)."""
    import moto.s3.models as models

    real = models.utcnow

    def shifted() -> datetime.datetime:
        return real() + datetime.timedelta(seconds=offset_secs)

    models.utcnow = shifted
    try:
        yield
    finally:
        models.utcnow = real


def backdate(backend: Backend, prefix: str, age_secs: float, moto_s3: MotoS3 | None = None) -> list[str]:
    """Make every object under ``prefix`` (relative to the store root) ``age_secs`` old on the
    store's clock.

    Local: ``os.utime`` of each file. S3 (moto): each object is copied onto itself (metadata
    replaced, so S3 accepts the copy) under :func:`moto_clock`.

    Returns:
        list[str]: the objects backdated, relative to the store root.

    Raises:
        ValueError: ``backend`` is neither local nor S3 with its ``moto_s3`` server given.
    """
    if backend.name == "local":
        root = Path(backend.url)
        stamp = time.time() - age_secs
        done = []
        for path in sorted((root / prefix).rglob("*")):
            if path.is_file():
                os.utime(path, (stamp, stamp))
                done.append(str(path.relative_to(root)))
        return done
    if backend.name != "s3" or moto_s3 is None:
        raise ValueError(f"backdate works on local and moto stores, not {backend.name}")
    client = moto_s3.boto3_client()
    bucket, _, root = backend.url[len("s3://"):].partition("/")
    keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{root}/{prefix}") for item in page.get("Contents", [])]
    with moto_clock(-age_secs):
        for key in keys:
            client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key},
                               MetadataDirective="REPLACE", Metadata={"backdated": str(int(age_secs))})
    return [key[len(root) + 1:] for key in keys]


__all__ = ["backdate", "moto_clock"]
