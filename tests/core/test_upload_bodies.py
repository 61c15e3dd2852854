"""How an S3 upload's body reaches the connection: views of the part buffer, no copy, no thread hop
(``opd_store.storage.s3_transfers.PartBody``)."""

from __future__ import annotations


class _RecordingWriter:
    """aiohttp's stream writer as a payload sees it: records what it is handed."""

    def __init__(self) -> None:
        self.chunks: list = []

    async def write(self, chunk) -> None:
        self.chunks.append(chunk)


def test_an_upload_body_goes_to_the_connection_as_views_of_its_part_buffer():
    import asyncio

    from aiobotocore._endpoint_helpers import _IOBaseWrapper  # what aiobotocore hands aiohttp
    from aiohttp import payload as aiohttp_payload

    from opd_store.storage.parts import MemoryReader
    from opd_store.storage.s3_transfers import SEND_CHUNK_BYTES, PartBody

    buffer = bytearray(bytes(range(251)) * (3 * SEND_CHUNK_BYTES // 251 + 1))
    body = PartBody(buffer)
    body.seek(10)  # a body is sent from where botocore left it
    payload = aiohttp_payload.PAYLOAD_REGISTRY.get(_IOBaseWrapper(body))
    assert payload.size == len(buffer) - 10
    writer = _RecordingWriter()
    asyncio.run(payload.write_with_length(writer, None))
    # No copy: every chunk is a view of the part buffer itself, at most SEND_CHUNK_BYTES long.
    assert all(isinstance(chunk, memoryview) and chunk.obj is buffer for chunk in writer.chunks)
    assert [chunk.nbytes for chunk in writer.chunks] == [SEND_CHUNK_BYTES] * 3 + [len(buffer) - 10 - 3 * SEND_CHUNK_BYTES]
    assert b"".join(writer.chunks) == bytes(buffer[10:])
    # Sent again (a redirect): from the same start; a Content-Length cuts it.
    again = _RecordingWriter()
    asyncio.run(payload.write_with_length(again, 1000))
    assert b"".join(again.chunks) == bytes(buffer[10:1010])
    # Only part bodies: any other reader keeps aiohttp's own file payload.
    assert type(aiohttp_payload.PAYLOAD_REGISTRY.get(MemoryReader(buffer))) is not type(payload)
    assert isinstance(aiohttp_payload.PAYLOAD_REGISTRY.get(MemoryReader(buffer)), aiohttp_payload.IOBasePayload)
