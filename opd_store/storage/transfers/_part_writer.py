"""The parallel part writer every remote backend shares: :class:`PartWriter`.

A write-only binary file for one object. The bytes written are copied into part buffers from the
store's :class:`~opd_store.storage.transfers._parts.PartPool`; each full buffer goes up as a part while the
caller keeps writing, up to ``parts_in_flight`` at once across the store. A payload of at most one
part is one request. :meth:`PartWriter.finish` seals the payload and returns a
:class:`~opd_store.storage.transfers._parts.Completion` that assembles the parts in the background, so the next
payload of a save streams while this one's last parts are still moving. If any request fails after
the client's retries, whatever was uploaded is removed once the parts in flight have settled
(nothing is left on the server) and the failure is raised as
:class:`~opd_store.errors.PayloadUploadError` naming the object and the request (a refusal and a
failure to reach the store at all are left to the payload writer, which names them itself).

The requests themselves are a backend's :class:`Multipart` (S3: a multipart upload,
:mod:`opd_store.storage.s3._multipart`; GCS: temporary objects composed into the payload,
:mod:`opd_store.storage.gcs._composite`); they run on the backend client's own event loop
(``fs.loop``), with its credentials, endpoint, timeouts and retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import PayloadUploadError, ThrottledUploadError
from .._backend_errors import Meaning, classify, describe, is_unreachable
from ._parts import Completion, PartPool

if TYPE_CHECKING:
    from collections.abc import Coroutine

logger = logging.getLogger("opd_store.storage")


class Multipart(Protocol):
    """A backend's requests for one object uploaded in parts (every coroutine runs on ``fs.loop``).

    Attributes:
        url (str): the object's URL (for messages).
        loop (asyncio.AbstractEventLoop): the client's event loop.
    """

    url: str
    loop: Any

    def start(self) -> None:
        """Before the first part (called once, on the writer's thread): what must exist before a
        part can go up (S3: the multipart upload, created and waited for here, so that a refused
        upload is raised by ``write``).

        Raises:
            Exception: the request failed (named by :func:`named_error`).
        """

    async def put(self, body: bytearray | memoryview) -> None:
        """The whole object (at most one part) in one request."""

    async def upload_part(self, number: int, body: bytearray | memoryview) -> Any:
        """Part ``number`` (from 1) holding ``body``; what :meth:`complete` needs of it."""

    async def complete(self, parts: list[Any]) -> None:
        """Assemble the object from every part's answer, in order (after all of them landed)."""

    async def abort(self) -> None:
        """Remove whatever was uploaded (called once no part is in flight; its failure is logged
        by the writer, which reports the upload's own failure)."""


def named_error(url: str, request: str, exc: BaseException) -> BaseException:
    """``exc`` named: a :class:`PayloadUploadError` naming the object and the request, with the
    backend's error as its cause. A refusal (403) and a failure to reach the store (a refused or
    closed connection, a timeout) stay as they are: the payload writer reports them as a permission
    error naming the operation or as a :class:`~opd_store.errors.StoreUnreachableError` naming the
    payload, the step and the endpoint. A :class:`ThrottledUploadError` (throttled past
    ``throttle_timeout_secs``) keeps its type."""
    if classify(exc) is Meaning.DENIED or is_unreachable(exc):
        return exc
    if isinstance(exc, ThrottledUploadError):  # from paced: the request and the object named here
        named = ThrottledUploadError(f"{url}: {request} failed after the client's retries ({exc}); the upload is "
                                     "aborted and the object not written")
        named.__cause__ = exc.__cause__
        return named
    named = PayloadUploadError(f"{url}: {request} failed after the client's retries ({describe(exc)}); "
                               "the upload is aborted and the object not written")
    named.__cause__ = exc
    return named


class PartWriter:
    """A write-only binary file for one object, uploaded in parallel parts (module docstring).

    Args:
        multipart (Multipart): the backend's requests for the object.
        pool (PartPool): the store's part buffers (their size is the part size).
    """

    def __init__(self, multipart: Multipart, pool: PartPool) -> None:
        self._multipart = multipart
        self.url = multipart.url
        self._pool = pool
        self._buffer: bytearray | None = None
        self._fill = 0
        self._size_bytes = 0
        self._started = False
        self._parts: list[concurrent.futures.Future] = []
        self._failure: BaseException | None = None
        self._aborted = False
        self._lock = threading.Lock()
        self._state = "open"

    def _run(self, coroutine: "Coroutine") -> concurrent.futures.Future:
        """Schedule ``coroutine`` on the client's event loop thread; its future, at once."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._multipart.loop)

    # -- file protocol -------------------------------------------------------------------------
    def write(self, data) -> int:
        """Copy ``data`` into part buffers; each full one starts uploading as soon as a byte follows it.

        Raises:
            PayloadUploadError: an earlier part failed (the upload is being aborted).
            ValueError: the writer is finished or discarded.
        """
        if self._state != "open":
            raise ValueError(f"write to a {self._state} part writer ({self.url})")
        if self._failure is not None:
            raise self._failure
        view = memoryview(data).cast("B")
        total = view.nbytes
        part_size = self._pool.part_size_bytes
        while view.nbytes:
            # A full buffer goes up once a byte follows it: a payload of exactly one part is then
            # still one request at finish.
            if self._fill == part_size:
                self._submit_part()
            if self._buffer is None:
                self._buffer = self._pool.acquire()
            count = min(view.nbytes, part_size - self._fill)
            self._buffer[self._fill:self._fill + count] = view[:count]
            self._fill += count
            view = view[count:]
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
        """Upload the full current buffer as the next part (starting the upload first)."""
        if not self._started:
            self._started = True
            self._multipart.start()
        buffer, self._buffer, self._fill = self._buffer, None, 0
        self._pool.flying()
        self._send_part(buffer)

    def _send_part(self, buffer: bytearray, body: memoryview | None = None) -> None:
        """Upload ``body`` (``buffer`` itself by default, or a view of its first bytes) as the next
        part; ``buffer`` goes back to the pool when the request has settled."""
        number = len(self._parts) + 1
        future = self._run(self._multipart.upload_part(number, buffer if body is None else body))
        future.add_done_callback(lambda done: self._part_done(done, buffer))
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

    # -- publish or discard --------------------------------------------------------------------
    def finish(self) -> Completion:
        """Seal the object: upload what is buffered and assemble the parts in the background.

        Returns:
            Completion: waits for the object to be published; raises
            :class:`~opd_store.errors.PayloadUploadError` (whatever was uploaded removed) otherwise.

        Raises:
            ValueError: the writer is already finished or discarded.
        """
        if self._state != "open":
            raise ValueError(f"finish of a {self._state} part writer ({self.url})")
        self._state = "finishing"
        tail = self._take_tail()
        if not self._started:  # at most one part: one request
            if tail is None:
                return Completion(self._run(self._put(bytearray())))
            buffer, body = tail
            future = self._run(self._put(body))
            future.add_done_callback(lambda _done: self._pool.release(buffer, was_flying=True))
            return Completion(future)
        if tail is not None:
            self._send_part(*tail)
        return Completion(self._run(self._complete()))

    def close(self) -> None:
        """Publish and wait (the file protocol; :meth:`finish` returns at once instead)."""
        if self._state == "open":
            self.finish().wait()

    def discard(self) -> None:
        """Abort without publishing: wait for the parts in flight, then remove them (best effort)."""
        if self._state in ("discarded", "done"):
            return
        self._state = "discarded"
        self._drop_buffer()
        if self._started and not self._aborted:
            try:
                self._run(self._abort()).result()
            except Exception:  # noqa: BLE001 - cleanup of an already failing save
                logger.warning("could not abort the parts of %s", self.url, exc_info=True)

    def _take_tail(self) -> tuple[bytearray, memoryview] | None:
        """The buffer being filled, counted in flight (its request gives it back to the pool), and a
        view of the bytes it holds; ``None`` when nothing is buffered.

        The last part (or the only object) goes up from the pool's own buffer, so every byte a
        save holds for upload is one of the pool's ``parts_in_flight`` buffers: payloads whose
        publishes run in the background cannot pile up copies of their tails. The buffer is never
        resized: a request that failed may leave views of it alive in a traceback until the
        garbage collector runs, and a ``bytearray`` with live views cannot be resized
        (``BufferError``), which would fail the next save that reuses it.
        """
        buffer, fill = self._buffer, self._fill
        self._buffer, self._fill = None, 0
        if buffer is None or not fill:
            if buffer is not None:
                self._pool.release(buffer, was_flying=False)
            return None
        self._pool.flying()
        return buffer, memoryview(buffer)[:fill]

    def _drop_buffer(self) -> None:
        if self._buffer is not None:
            self._pool.release(self._buffer, was_flying=False)
            self._buffer, self._fill = None, 0

    async def _put(self, body: bytearray | memoryview) -> None:
        await self._multipart.put(body)
        self._state = "done"

    async def _settled_parts(self) -> list[Any]:
        """Every part's outcome (a result or the exception), once none is in flight."""
        return await asyncio.gather(*(asyncio.wrap_future(part) for part in self._parts), return_exceptions=True)

    async def _complete(self) -> None:
        outcomes = await self._settled_parts()
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is None:
            try:
                await self._multipart.complete(outcomes)
                self._state = "done"
                return
            except Exception as exc:  # noqa: BLE001 - the parts are removed, then it is raised
                failed = exc
        try:
            await self._abort()
        except Exception:  # noqa: BLE001 - the upload's own failure is the one to report
            logger.warning("could not abort the parts of %s", self.url, exc_info=True)
        raise failed

    async def _abort(self) -> None:
        """Remove the parts once none is in flight (S3: a part still uploading during the abort
        could otherwise be stored after it; GCS: a temporary object created after the deletes)."""
        await self._settled_parts()
        self._aborted = True
        await self._multipart.abort()


__all__ = ["Multipart", "PartWriter", "named_error"]
