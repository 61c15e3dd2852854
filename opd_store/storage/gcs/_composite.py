"""Parallel GCS uploads over gcsfs's asynchronous API: parallel composite uploads.

gcsfs's file writer sends a payload over one connection (a resumable upload, one chunk after the
other). ``Storage.open_write`` (a :class:`~opd_store.storage.transfers._part_writer.PartWriter` over
:class:`GCSComposite`) uploads it the way gcloud and gsutil's "parallel composite uploads" do
(GCS docs, "Parallel composite uploads"): each full part buffer goes up as a *temporary object*
beside the payload while the caller keeps writing, up to
``parts_in_flight`` at once (the shared :class:`~opd_store.storage.transfers._part_writer.PartWriter`), and
the payload is then assembled from them by ``compose``, on gcsfs's own event loop and aiohttp
session (its credentials, endpoint, timeouts and retries: 5xx, 408 and 429 back off up to 6 times).

==================  ==============================================================================
at most one part    one ``POST .../upload/storage/v1/b/B/o?uploadType=media&name=K`` (a single-
                    request upload; no temporary object, no compose)
each part           one ``uploadType=media`` upload of the temporary object
                    ``<payload>.part-<token>-00001``, ``-00002``... in the same attempt prefix. The
                    body is a :class:`~opd_store.storage.transfers._upload_bodies.PartBody` over the part
                    buffer, sent as views of it (no copy; gcsfs rewinds it for a retry), each
                    taken by the connection within the store's ``read_timeout_secs``.
finish              ``POST .../o/K/compose`` of the parts, in order. GCS composes at most 32
                    source objects per request (GCS docs, "Compose objects": "between 1 and 32
                    source objects"), so more parts are composed as a tree: groups of 32 into
                    temporary objects ``<payload>.part-<token>-c1-00001``..., then those, until one
                    request makes the payload. Then every temporary object is deleted, and only then
                    is the payload reported published: a save's manifest, created after every
                    payload's completion, never names an attempt that still holds temporary objects.
any failure         (after gcsfs's retries) every temporary object written is deleted once the parts
                    in flight have settled, and the failure is raised as
                    :class:`~opd_store.errors.PayloadUploadError` naming the object and the request;
                    a deletion that fails is logged, and the objects left are inside the attempt
                    prefix, which ``gc`` removes with the uncommitted attempt.
==================  ==============================================================================

A composite object has a CRC32C but no MD5 hash (GCS docs, "Composite objects": "Composite objects
do not have an MD5 hash metadata field"); opd_store checks its own CRC32C on every read, so nothing
here depends on an MD5. The reads are :mod:`opd_store.storage.gcs._reads`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any
from urllib.parse import quote

from ..transfers import Pacer, PartBody, named_error, paced

logger = logging.getLogger("opd_store.storage")

MAX_COMPOSE_SOURCES = 32
"""GCS's most source objects in one compose request (GCS docs, "Compose objects")."""

PART_MARKER = ".part-"
"""What every temporary part object's name holds after its payload's name."""


def compose_groups(names: list[str], fan_in: int = MAX_COMPOSE_SOURCES) -> list[list[list[str]]]:
    """The compose tree of ``names`` (in order): one list of groups per level, the last level one
    group. A group of level ``n > 0`` names the results of level ``n - 1`` by their index.

    Each level groups the previous one's results ``fan_in`` at a time (in order, so the bytes stay
    in order); a level of one group composes the payload.

    Args:
        names (list[str]): the part objects, in byte order (at least one).
        fan_in (int): sources per compose request (GCS: at most 32).

    Returns:
        list[list[list[str]]]: for each level, its groups of source names; level ``n > 0``'s
        sources are ``"<level-1>:<index>"`` placeholders for the previous level's results.
    """
    levels: list[list[list[str]]] = []
    sources = list(names)
    level = 0
    while True:
        groups = [sources[i:i + fan_in] for i in range(0, len(sources), fan_in)]
        levels.append(groups)
        if len(groups) == 1:
            return levels
        sources = [f"{level}:{i}" for i in range(len(groups))]
        level += 1


def upload_url(fs, bucket: str) -> str:
    """The JSON API's upload endpoint for ``bucket`` on ``fs``'s endpoint (``fs.base`` is
    ``<endpoint>/storage/v1/``; uploads go to ``<endpoint>/upload/storage/v1/b/<bucket>/o``)."""
    endpoint = fs.base.rstrip("/").removesuffix("/storage/v1")
    return f"{endpoint}/upload/storage/v1/b/{quote(bucket, safe='')}/o"


class GCSComposite:
    """One GCS object uploaded as composed temporary parts (a
    :class:`~opd_store.storage.transfers._part_writer.Multipart`).

    Args:
        fs: the store's ``gcsfs.GCSFileSystem``.
        bucket (str), key (str): the object.
        url (str): the object's URL (for messages).
        send_timeout_secs (float | None): the longest wait for a connection to take one chunk of a
            body (the store's ``read_timeout_secs``).
        pacer (Pacer | None): the store's pacing of upload requests (``transfers.pacer``): uploads
            and composes wait for a slot, and a throttled one is sent again after a back-off.

    Attributes:
        temporary (list[str]): keys of every temporary object this upload may have created (its
            parts and intermediate composites), in the order they were started.
    """

    def __init__(self, fs, bucket: str, key: str, url: str, *, send_timeout_secs: float | None = None,
                 pacer: Pacer | None = None) -> None:
        self._fs = fs
        self._send_timeout_secs = send_timeout_secs
        self._pacer = pacer
        self._bucket = bucket
        self._key = key
        self.url = url
        self.loop = fs.loop
        self._token = secrets.token_hex(4)
        self.temporary: list[str] = []

    def start(self) -> None:
        """Nothing to create before the first part (a part is an object of its own)."""

    def _temporary_key(self, suffix: str) -> str:
        key = f"{self._key}{PART_MARKER}{self._token}-{suffix}"
        self.temporary.append(key)
        return key

    async def _media_upload(self, request: str, key: str, body: bytearray | memoryview) -> dict[str, Any]:
        """One single-request upload (``uploadType=media``) of ``body`` as ``key``; its JSON answer."""

        async def send() -> dict[str, Any]:
            reader = PartBody(body, send_timeout_secs=self._send_timeout_secs)
            try:
                return await self._fs._call(
                    "POST", upload_url(self._fs, self._bucket),
                    uploadType="media", name=key, data=reader, json_out=True,
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(body))})
            finally:
                reader.close()

        try:
            return await paced(self._pacer, send)
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, request, exc)  # noqa: B904 - the cause is set by named_error

    async def put(self, body: bytearray | memoryview) -> None:
        await self._media_upload("upload", self._key, body)

    async def upload_part(self, number: int, body: bytearray | memoryview) -> str:
        key = self._temporary_key(f"{number:05d}")
        await self._media_upload(f"upload of part {number} ({key.rpartition('/')[2]})", key, body)
        return key

    async def _compose(self, sources: list[str], destination: str) -> None:
        try:
            await paced(self._pacer, lambda: self._fs._call(
                "POST", "b/{}/o/{}/compose", self._bucket, destination,
                json={"kind": "storage#composeRequest", "sourceObjects": [{"name": s} for s in sources],
                      "destination": {"name": destination, "bucket": self._bucket,
                                      "contentType": "application/octet-stream"}},
                headers={"Content-Type": "application/json"}, json_out=True))
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, f"compose of {len(sources)} objects into {destination.rpartition('/')[2]}",
                              exc)  # noqa: B904 - the cause is set by named_error

    async def complete(self, parts: list[Any]) -> None:
        """Compose ``parts`` (their keys, in order) into the object (a tree above 32), then delete
        every temporary object.

        Raises:
            PayloadUploadError: a compose or a deletion failed after gcsfs's retries (the caller
                then removes the temporary objects; a payload composed already is overwritten by
                the next attempt or removed with its uncommitted attempt).
        """
        results: list[str] = []
        levels = compose_groups(list(parts), MAX_COMPOSE_SOURCES)
        for depth, groups in enumerate(levels):
            sources = [[results[int(s.partition(":")[2])] if depth else s for s in group] for group in groups]
            last = depth == len(levels) - 1
            targets = [self._key] if last else [self._temporary_key(f"c{depth + 1}-{i + 1:05d}")
                                                 for i in range(len(groups))]
            await asyncio.gather(*(self._compose(group, target) for group, target in zip(sources, targets)))
            results = targets
        await self._delete_temporary(strict=True)

    async def abort(self) -> None:
        await self._delete_temporary(strict=False)

    async def _delete_temporary(self, *, strict: bool) -> None:
        """Delete every temporary object (one request each, concurrently; one never created is
        gone already).

        Raises:
            PayloadUploadError: ``strict`` and a deletion failed after gcsfs's retries (the
                payload is then not reported published, so no manifest names an attempt holding it).
        """
        keys, self.temporary = self.temporary, []
        outcomes = await asyncio.gather(*(self._delete(key) for key in keys), return_exceptions=True)
        failed = [(key, o) for key, o in zip(keys, outcomes) if isinstance(o, BaseException)]
        if not failed:
            return
        self.temporary = [key for key, _ in failed]  # an abort after a failed finish tries them again
        key, exc = failed[0]
        if strict:
            raise named_error(self.url, f"delete of {len(failed)} temporary part objects ({key.rpartition('/')[2]}...)",
                              exc)
        logger.warning("%s: could not delete %d temporary part objects (%s...): %r; `opd-store gc` removes them "
                       "with the uncommitted attempt", self.url, len(failed), key, exc)

    async def _delete(self, key: str) -> None:
        try:
            await self._fs._call("DELETE", "b/{}/o/{}", self._bucket, key)
        except FileNotFoundError:  # never created (a part that failed), or deleted already
            pass


__all__ = ["GCSComposite", "MAX_COMPOSE_SOURCES", "PART_MARKER", "compose_groups"]
