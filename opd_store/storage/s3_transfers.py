"""Parallel S3 uploads over s3fs's asynchronous API: the multipart requests of
:class:`~opd_store.storage.part_writer.PartWriter`.

s3fs's file writer uploads a multipart upload one part at a time (its source: "TODO: concurrent
here"). ``Storage.open_write`` (a :class:`~opd_store.storage.part_writer.PartWriter` over
:class:`S3Multipart`) uploads a payload as an S3 multipart upload whose parts go up while the
caller keeps writing, up to ``parts_in_flight`` at once, on s3fs's own event loop and client (its
credentials, endpoint, timeouts and botocore's retries, which back off on ``503 SlowDown``);
the reads are :mod:`opd_store.storage.s3_reads`. A payload of at most one part is
one ``PutObject``. Each request's body is a seekable reader over its part buffer
(:class:`~opd_store.storage.parts.MemoryReader`), sent in chunks: a ``bytes`` body is copied whole
into asyncio's transport buffer while the socket drains, a second copy of every part in flight
(docs/performance.md). If any request fails after the client's retries, the whole multipart upload
is aborted once the parts in flight have settled (no upload is left open on the server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from .backend_errors import Meaning, classify
from .part_writer import named_error
from .parts import MemoryReader


class S3Multipart:
    """One S3 object's multipart upload (a :class:`~opd_store.storage.part_writer.Multipart`).

    Args:
        fs: the store's ``s3fs.S3FileSystem``.
        bucket (str), key (str): the object.
        url (str): the object's URL (for messages).
    """

    def __init__(self, fs, bucket: str, key: str, url: str) -> None:
        self._fs = fs
        self._bucket = bucket
        self._key = key
        self.url = url
        self.loop = fs.loop
        self._upload_id: concurrent.futures.Future | None = None

    def start(self) -> None:
        """``CreateMultipartUpload``, waited for (one short request): a refused upload is raised by
        the write that filled the first part, and an upload is open on the server once a part was
        handed over."""
        self._upload_id = asyncio.run_coroutine_threadsafe(self._create(), self.loop)
        self._upload_id.result()

    async def _create(self) -> str:
        try:
            answer = await self._fs._call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, "CreateMultipartUpload", exc)  # noqa: B904 - the cause is set
        return answer["UploadId"]

    async def _send(self, request: str, operation: str, body: bytearray, **kwargs: Any) -> dict:
        reader = MemoryReader(body)
        try:
            return await self._fs._call_s3(operation, Bucket=self._bucket, Key=self._key, Body=reader, **kwargs)
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, request, exc)  # noqa: B904 - the cause is set by named_error
        finally:
            reader.close()

    async def put(self, body: bytearray) -> None:
        await self._send("PutObject", "put_object", body)

    async def upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        upload_id = await asyncio.wrap_future(self._upload_id)
        answer = await self._send(f"UploadPart {number}", "upload_part", body, UploadId=upload_id, PartNumber=number)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    async def complete(self, parts: list[Any]) -> None:
        upload_id = await asyncio.wrap_future(self._upload_id)
        try:
            await self._fs._call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                    UploadId=upload_id, MultipartUpload={"Parts": parts})
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, "CompleteMultipartUpload", exc)  # noqa: B904 - the cause is set

    async def abort(self) -> None:
        """``AbortMultipartUpload`` (AWS: once no part is in flight, or a part still uploading could
        be stored after it); an upload already gone, or never created, is aborted."""
        try:
            upload_id = await asyncio.wrap_future(self._upload_id)
        except Exception:  # noqa: BLE001 - the upload was never created: nothing to abort
            return
        try:
            await self._fs._call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - an upload already gone is aborted
            if classify(exc) is not Meaning.NOT_FOUND:
                raise


__all__ = ["S3Multipart"]
