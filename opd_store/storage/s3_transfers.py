"""Parallel S3 uploads over s3fs's asynchronous API: the part writer.

s3fs's file writer uploads a multipart upload one part at a time (its source: "TODO: concurrent
here"). A store here moves a payload over several connections at once, on s3fs's own event loop
and client (its credentials, endpoint, timeouts and botocore's retries, which back off on ``503
SlowDown``); the reads are :mod:`opd_store.storage.s3_reads`.

:class:`S3PartWriter` (``Storage.open_write``): the bytes written are copied into part buffers
  from the store's :class:`~opd_store.storage.parts.PartPool`; each full buffer goes up as an
  ``UploadPart`` while the caller keeps writing, up to ``parts_in_flight`` at once. A payload of at
  most one part is one ``PutObject``. :meth:`S3PartWriter.finish` seals the payload and returns a
  :class:`~opd_store.storage.parts.Completion` that completes the upload in the background, so the
  next payload of the save streams while this one's last parts are still moving. Each request's
  body is a seekable reader over its part buffer (:class:`~opd_store.storage.parts.MemoryReader`),
  sent in chunks: a ``bytes`` body is copied whole into asyncio's transport buffer while the socket
  drains, a second copy of every part in flight (docs/performance.md). If any request
  fails after the client's retries, the whole multipart upload is aborted once the parts in flight
  have settled (no upload is left open on the server) and the failure is raised as
  :class:`~opd_store.errors.PayloadUploadError` naming the object and the request
  (a failure to reach the store at all is left to the payload writer, which reports it as
  :class:`~opd_store.errors.StoreUnreachableError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

from ..errors import PayloadUploadError
from .backend_errors import Meaning, classify, describe, is_unreachable
from .parts import Completion, MemoryReader, PartPool

if TYPE_CHECKING:
    from collections.abc import Coroutine

logger = logging.getLogger("opd_store.storage")

def _run(fs, coroutine: "Coroutine") -> concurrent.futures.Future:
    """Schedule ``coroutine`` on s3fs's event loop thread; its future, at once."""
    return asyncio.run_coroutine_threadsafe(coroutine, fs.loop)


class S3PartWriter:
    """A write-only binary file for one S3 object, uploaded in parallel parts (module docstring).

    Args:
        fs: the store's ``s3fs.S3FileSystem``.
        bucket (str), key (str): the object.
        url (str): the object's URL (for messages).
        pool (PartPool): the store's part buffers (their size is the part size).
    """

    def __init__(self, fs, bucket: str, key: str, url: str, pool: PartPool) -> None:
        self._fs = fs
        self._bucket = bucket
        self._key = key
        self.url = url
        self._pool = pool
        self._buffer: bytearray | None = None
        self._fill = 0
        self._size_bytes = 0
        self._upload_id: concurrent.futures.Future | None = None
        self._parts: list[concurrent.futures.Future] = []
        self._failure: BaseException | None = None
        self._aborted = False
        self._lock = threading.Lock()
        self._state = "open"

    # -- file protocol -------------------------------------------------------------------------
    def write(self, data) -> int:
        """Copy ``data`` into part buffers; each full one starts uploading at once.

        Raises:
            PayloadUploadError: an earlier part failed (the upload is being aborted).
            ValueError: the writer is finished or discarded.
        """
        if self._state != "open":
            raise ValueError(f"write to a {self._state} S3 writer ({self.url})")
        if self._failure is not None:
            raise self._failure
        view = memoryview(data).cast("B")
        total = view.nbytes
        part_size = self._pool.part_size_bytes
        while view.nbytes:
            if self._buffer is None:
                self._buffer = self._pool.acquire()
            count = min(view.nbytes, part_size - self._fill)
            self._buffer[self._fill:self._fill + count] = view[:count]
            self._fill += count
            view = view[count:]
            if self._fill == part_size:
                self._submit_part()
        self._size_bytes += total
        return total

    def tell(self) -> int:
        return self._size_bytes

    def flush(self) -> None:
        """Nothing: full parts are already uploading; the last one goes at :meth:`finish`."""

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._state != "open"

    # -- parts ---------------------------------------------------------------------------------
    def _submit_part(self) -> None:
        """Upload the full current buffer as the next part (creating the upload first).

        The first part waits for ``CreateMultipartUpload`` (one short request): a refused upload
        is raised here, and an upload is open on the server once a part was handed over.
        """
        if self._upload_id is None:
            self._upload_id = _run(self._fs, self._create())
            self._upload_id.result()
        buffer, self._buffer, self._fill = self._buffer, None, 0
        number = len(self._parts) + 1
        self._pool.flying()
        future = _run(self._fs, self._upload_part(number, buffer))
        future.add_done_callback(lambda done, buffer=buffer: self._part_done(done, buffer))
        self._parts.append(future)

    def _part_done(self, done: concurrent.futures.Future, buffer: bytearray) -> None:
        self._pool.release(buffer, was_flying=True)
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            with self._lock:
                if self._failure is None:
                    self._failure = exc

    async def _create(self) -> str:
        try:
            answer = await self._fs._call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        except Exception as exc:  # noqa: BLE001 - named below
            raise self._error("CreateMultipartUpload", exc)  # noqa: B904 - the cause is set by _error
        return answer["UploadId"]

    async def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        upload_id = await asyncio.wrap_future(self._upload_id)
        reader = MemoryReader(body)
        try:
            answer = await self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, UploadId=upload_id,
                                             PartNumber=number, Body=reader)
        except Exception as exc:  # noqa: BLE001 - named below
            raise self._error(f"UploadPart {number}", exc)  # noqa: B904 - the cause is set by _error
        finally:
            reader.close()
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _error(self, request: str, exc: BaseException) -> BaseException:
        """``exc`` named: a :class:`PayloadUploadError` naming the object and the request, with
        the backend's error as its cause. A refusal (403) and a failure to reach the store (a
        refused or closed connection, a timeout) stay as they are: the payload writer reports
        them as a permission error naming the operation or as a
        :class:`~opd_store.errors.StoreUnreachableError` naming the payload, the step and the
        endpoint."""
        if classify(exc) is Meaning.DENIED or is_unreachable(exc):
            return exc
        named = PayloadUploadError(f"{self.url}: {request} failed after the client's retries ({describe(exc)}); "
                                   "the upload is aborted and the object not written")
        named.__cause__ = exc
        return named

    # -- publish or discard --------------------------------------------------------------------
    def finish(self) -> Completion:
        """Seal the object: upload what is buffered and complete the upload in the background.

        Returns:
            Completion: waits for the object to be published; raises
            :class:`~opd_store.errors.PayloadUploadError` (the upload aborted) otherwise.
        """
        if self._state != "open":
            raise ValueError(f"finish of a {self._state} S3 writer ({self.url})")
        self._state = "finishing"
        tail = self._take_tail()
        if self._upload_id is None:  # at most one part: one PutObject
            future = _run(self._fs, self._put(tail if tail is not None else bytearray()))
            if tail is not None:
                future.add_done_callback(lambda _done: self._pool.release(tail, was_flying=True))
            return Completion(future)
        if tail is not None:
            number = len(self._parts) + 1
            future = _run(self._fs, self._upload_part(number, tail))
            future.add_done_callback(lambda done: self._part_done(done, tail))
            self._parts.append(future)
        return Completion(_run(self._fs, self._complete()))

    def close(self) -> None:
        """Publish and wait (the file protocol; :meth:`finish` returns at once instead)."""
        if self._state == "open":
            self.finish().wait()

    def discard(self) -> None:
        """Abort without publishing: wait for the parts in flight, then abort the upload (best effort)."""
        if self._state in ("discarded", "done"):
            return
        self._state = "discarded"
        self._drop_buffer()
        if self._upload_id is not None and not self._aborted:
            try:
                _run(self._fs, self._abort()).result()
            except Exception:  # noqa: BLE001 - cleanup of an already failing save
                logger.warning("could not abort the multipart upload of %s", self.url, exc_info=True)

    def _take_tail(self) -> bytearray | None:
        """The buffer being filled, cut in place to the bytes it holds and counted in flight (its
        request gives it back to the pool); ``None`` when nothing is buffered.

        The last part (or the only object) goes up from the pool's own buffer, so every byte a
        save holds for upload is one of the pool's ``parts_in_flight`` buffers: payloads whose
        publishes run in the background cannot pile up copies of their tails.
        """
        buffer, fill = self._buffer, self._fill
        self._buffer, self._fill = None, 0
        if buffer is None or not fill:
            if buffer is not None:
                self._pool.release(buffer, was_flying=False)
            return None
        del buffer[fill:]
        self._pool.flying()
        return buffer

    def _drop_buffer(self) -> None:
        if self._buffer is not None:
            self._pool.release(self._buffer, was_flying=False)
            self._buffer, self._fill = None, 0

    async def _put(self, body: bytearray) -> None:
        reader = MemoryReader(body)
        try:
            await self._fs._call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=reader)
        except Exception as exc:  # noqa: BLE001 - named below
            raise self._error("PutObject", exc)  # noqa: B904 - the cause is set by _error
        finally:
            reader.close()
        self._state = "done"

    async def _settled_parts(self) -> list[Any]:
        """Every part's outcome (a result or the exception), once none is in flight."""
        return await asyncio.gather(*(asyncio.wrap_future(part) for part in self._parts), return_exceptions=True)

    async def _complete(self) -> None:
        outcomes = await self._settled_parts()
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is None:
            upload_id = await asyncio.wrap_future(self._upload_id)
            try:
                await self._fs._call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                        UploadId=upload_id, MultipartUpload={"Parts": outcomes})
                self._state = "done"
                return
            except Exception as exc:  # noqa: BLE001 - named below
                failed = self._error("CompleteMultipartUpload", exc)
        await self._abort()
        raise failed

    async def _abort(self) -> None:
        """Abort the upload once no part is in flight (AWS: a part still uploading during the abort
        could otherwise be stored after it)."""
        await self._settled_parts()
        self._aborted = True
        try:
            upload_id = await asyncio.wrap_future(self._upload_id)
        except Exception:  # noqa: BLE001 - the upload was never created: nothing to abort
            return
        try:
            await self._fs._call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - an upload already gone is aborted
            if classify(exc) is not Meaning.NOT_FOUND:
                raise


__all__ = ["S3PartWriter"]
