"""Parallel S3 uploads over s3fs's asynchronous API: the multipart requests of
:class:`~opd_store.storage.transfers._part_writer.PartWriter`.

s3fs's file writer uploads a multipart upload one part at a time (its source: "TODO: concurrent
here"). ``Storage.open_write`` (a :class:`~opd_store.storage.transfers._part_writer.PartWriter` over
:class:`S3Multipart`) uploads a payload as an S3 multipart upload whose parts go up while the
caller keeps writing, up to ``parts_in_flight`` at once, on s3fs's own event loop and client (its
credentials, endpoint, timeouts and botocore's retries, which back off on ``503 SlowDown``);
the reads are :mod:`opd_store.storage.s3._reads`. A payload of at most one part is
one ``PutObject``. If any request fails after the client's retries, the whole multipart upload is
aborted once the parts in flight have settled (no upload is left open on the server).

Each body carries its CRC32C (``ChecksumCRC32C``; the upload is created with
``ChecksumAlgorithm=CRC32C`` and completed with every part's checksum, as S3's "Checking object
integrity" documentation asks of multipart uploads with checksums): the server refuses a part whose
bytes differ from the part buffer's (``BadDigest``), and botocore, given the checksum, does not read
the body to compute one of its own (a client configured with
``request_checksum_calculation=when_required`` sends none, as botocore would not). The body is a
:class:`~opd_store.storage.transfers._upload_bodies.PartBody` over the part buffer: sent as views of the
buffer, each taken by the connection within the store's ``read_timeout_secs`` (an endpoint that
stops reading a body fails the attempt instead of holding the save).

Every request that writes (create, parts, complete, a one-request ``PutObject``) goes through the
store's :class:`~opd_store.storage.transfers._pacing.Pacer`: it waits for a slot, and one the
client's retries gave up on as throttled is sent again after a jittered back-off. The pacer also
hears of each throttled answer as it arrives (botocore's ``response-received`` event on the
client), and botocore leaves the retry of a throttled payload write to it
(:func:`watch_throttling`), so the store's concurrency halves at the first ``503 SlowDown`` and
every new attempt waits for the pacer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

from ...format import crc32c_base64
from .._backend_errors import Meaning, classify, s3_answer_meaning
from ..transfers import Pacer, PartBody, named_error, paced

_WATCHED_OPERATIONS = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")


def _throttled(parsed_response: Any, status: Any) -> bool:
    error = parsed_response.get("Error") if isinstance(parsed_response, dict) else None
    code = error.get("Code") if isinstance(error, dict) else None
    return s3_answer_meaning(code, status) is Meaning.THROTTLED


def watch_throttling(client: Any, pacer: Pacer) -> None:
    """Report every throttled answer to a write of ``client`` to ``pacer`` as it arrives, and
    leave the retry of a throttled payload write to the pacer (once per client and pacer).

    botocore's ``response-received`` event fires for each HTTP attempt. Its retry handler would
    send a throttled write again after its own short back-off, outside the pacer's slots and
    spacing, twice per pass of s3fs's loop: the retries of hundreds of ranks would then arrive
    together whatever the pacer does. A ``needs-retry`` handler ahead of botocore's declines the
    retry of a throttled answer to a payload write (a key under an attempt prefix; the manifest's
    create keeps botocore's retries), so the write comes back to :func:`paced` at once.
    """

    def heard(parsed_response: Any = None, response_dict: Any = None, **_kwargs: Any) -> None:
        if isinstance(response_dict, dict) and _throttled(parsed_response, response_dict.get("status_code")):
            pacer.throttled()

    def no_retry(response: Any = None, request_dict: Any = None, **_kwargs: Any) -> bool | None:
        if not (isinstance(response, tuple) and len(response) == 2 and isinstance(request_dict, dict)):
            return None
        http_response, parsed = response
        if "/attempt-" in str(request_dict.get("url_path", "")) and _throttled(
                parsed, getattr(http_response, "status_code", None)):
            return False  # the first answer that is not None decides: no retry by botocore
        return None

    for operation in _WATCHED_OPERATIONS:
        client.meta.events.register(f"response-received.s3.{operation}", heard,
                                    unique_id=f"opd-store-pacer-{id(pacer)}-{operation}")
        if pacer.adaptive:
            client.meta.events.register_first(f"needs-retry.s3.{operation}", no_retry,
                                              unique_id=f"opd-store-pacer-retry-{id(pacer)}-{operation}")
    pacer.watches_answers = True

logger = logging.getLogger("opd_store.storage")


class S3Multipart:
    """One S3 object's multipart upload (a :class:`~opd_store.storage.transfers._part_writer.Multipart`).

    Args:
        fs: the store's ``s3fs.S3FileSystem``.
        bucket (str), key (str): the object.
        url (str): the object's URL (for messages).
        send_timeout_secs (float | None): the longest wait for a connection to take one chunk of a
            body (the store's ``read_timeout_secs``).
        pacer (Pacer | None): the store's pacing of upload requests (module docstring).
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
        self._upload_id: concurrent.futures.Future | None = None
        self._created_again = False
        self._checksums: bool | None = None

    def start(self) -> None:
        """``CreateMultipartUpload``, waited for (one short request): a refused upload is raised by
        the write that filled the first part, and an upload is open on the server once a part was
        handed over."""
        self._upload_id = asyncio.run_coroutine_threadsafe(self._create(), self.loop)
        self._upload_id.result()

    async def _create(self) -> str:
        """``CreateMultipartUpload``. A create whose reply was lost may have opened an upload that
        the client's retry does not return (the retry opens another): when the client retried, or
        the create failed, the uploads of this key other than the one in use are aborted once the
        payload is settled (:meth:`_abort_others`); the key is unique to the save attempt, so each
        of them is this writer's."""
        algorithm = {"ChecksumAlgorithm": "CRC32C"} if await self._send_checksums() else {}
        try:
            answer = await paced(self._pacer, lambda: self._fs._call_s3(
                "create_multipart_upload", Bucket=self._bucket, Key=self._key, **algorithm))
        except Exception as exc:  # noqa: BLE001 - named below
            await self._abort_others(None)
            raise named_error(self.url, "CreateMultipartUpload", exc)  # noqa: B904 - the cause is set
        self._created_again = bool((answer.get("ResponseMetadata") or {}).get("RetryAttempts"))
        return answer["UploadId"]

    async def _send_checksums(self) -> bool:
        """Whether bodies carry their CRC32C: unless the client is configured to send checksums only
        where an operation requires them (botocore's ``request_checksum_calculation=when_required``,
        also ``AWS_REQUEST_CHECKSUM_CALCULATION``), the setting S3-compatible servers that refuse
        checksum headers ask for."""
        if self._checksums is None:
            client = await self._fs.set_session()
            setting = getattr(client.meta.config, "request_checksum_calculation", None)
            self._checksums = setting != "when_required"
            if self._pacer is not None:
                watch_throttling(client, self._pacer)
        return self._checksums

    async def _checksum(self, body: bytearray | memoryview) -> dict[str, str]:
        return {"ChecksumCRC32C": crc32c_base64(body)} if await self._send_checksums() else {}

    async def _abort_others(self, upload_id: str | None) -> None:
        """Abort every open upload of this key but ``upload_id`` (best effort: what is left is a
        stale upload that ``opd-store gc`` removes)."""
        try:
            listing = await self._fs._call_s3("list_multipart_uploads", Bucket=self._bucket, Prefix=self._key)
            for upload in listing.get("Uploads") or []:
                if upload.get("Key") == self._key and upload.get("UploadId") != upload_id:
                    await self._fs._call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                            UploadId=upload["UploadId"])
        except Exception:  # noqa: BLE001 - the payload's own outcome is what the caller gets
            logger.warning("could not abort the duplicate uploads of %s", self.url, exc_info=True)

    async def _send(self, request: str, operation: str, body: bytearray | memoryview, **kwargs: Any) -> dict:
        async def send() -> dict:
            reader = PartBody(body, send_timeout_secs=self._send_timeout_secs)
            try:
                return await self._fs._call_s3(operation, Bucket=self._bucket, Key=self._key, Body=reader, **kwargs)
            finally:
                reader.close()

        try:
            return await paced(self._pacer, send)
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, request, exc)  # noqa: B904 - the cause is set by named_error

    async def put(self, body: bytearray | memoryview) -> None:
        await self._send("PutObject", "put_object", body, **await self._checksum(body))

    async def upload_part(self, number: int, body: bytearray | memoryview) -> dict[str, Any]:
        upload_id = await asyncio.wrap_future(self._upload_id)
        checksum = await self._checksum(body)
        answer = await self._send(f"UploadPart {number}", "upload_part", body, UploadId=upload_id, PartNumber=number,
                                  **checksum)
        return {"PartNumber": number, "ETag": answer["ETag"], **checksum}

    async def complete(self, parts: list[Any]) -> None:
        upload_id = await asyncio.wrap_future(self._upload_id)
        try:
            await paced(self._pacer, lambda: self._fs._call_s3(
                "complete_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id,
                MultipartUpload={"Parts": parts}))
        except Exception as exc:  # noqa: BLE001 - named below
            raise named_error(self.url, "CompleteMultipartUpload", exc)  # noqa: B904 - the cause is set
        if self._created_again:
            await self._abort_others(upload_id)

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
        if self._created_again:
            await self._abort_others(upload_id)


__all__ = ["S3Multipart", "watch_throttling"]
