"""How an upload's body (S3 and GCS) reaches the connection: views of the part buffer, no copy, no thread hop
(``opd_store.storage.transfers._upload_bodies.PartBody``)."""

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

    from opd_store.storage.transfers import MemoryReader, PartBody
    from opd_store.storage.transfers._upload_bodies import SEND_CHUNK_BYTES

    buffer = bytearray(bytes(range(251)) * (3 * SEND_CHUNK_BYTES // 251 + 1))
    body = PartBody(buffer)
    body.seek(10)  # left half read by a failed attempt (s3fs's retry loop does not rewind it)
    payload = aiohttp_payload.PAYLOAD_REGISTRY.get(_IOBaseWrapper(body))
    assert payload.size == len(buffer)
    writer = _RecordingWriter()
    asyncio.run(payload.write_with_length(writer, None))
    # No copy: every chunk is a view of the part buffer itself, at most SEND_CHUNK_BYTES long.
    assert all(isinstance(chunk, memoryview) and chunk.obj is buffer for chunk in writer.chunks)
    assert [chunk.nbytes for chunk in writer.chunks] == [SEND_CHUNK_BYTES] * 3 + [len(buffer) - 3 * SEND_CHUNK_BYTES]
    assert b"".join(writer.chunks) == bytes(buffer)
    assert body.tell() == 0  # rewound for the next attempt: botocore takes a body's length from its position
    # Sent again (a redirect), after a read moved the position: the whole body again; a
    # Content-Length cuts it.
    body.seek(500)
    again = _RecordingWriter()
    asyncio.run(payload.write_with_length(again, 1000))
    assert b"".join(again.chunks) == bytes(buffer[:1000])
    # Only part bodies: any other reader keeps aiohttp's own file payload.
    assert type(aiohttp_payload.PAYLOAD_REGISTRY.get(MemoryReader(buffer))) is not type(payload)
    assert isinstance(aiohttp_payload.PAYLOAD_REGISTRY.get(MemoryReader(buffer)), aiohttp_payload.IOBasePayload)


class _StuckWriter(_RecordingWriter):
    """A connection that takes the first chunk and then never drains (a peer that stopped reading)."""

    async def write(self, chunk) -> None:
        import asyncio

        self.chunks.append(chunk)
        if len(self.chunks) > 1:
            await asyncio.get_running_loop().create_future()  # never done


def test_a_chunk_the_connection_does_not_take_within_the_send_timeout_fails_the_attempt():
    import asyncio

    import aiohttp
    import pytest
    from aiobotocore._endpoint_helpers import _IOBaseWrapper
    from aiohttp import payload as aiohttp_payload

    from opd_store.storage.transfers import PartBody
    from opd_store.storage.transfers._upload_bodies import SEND_CHUNK_BYTES, WRITE_TIMEOUT_MESSAGE

    buffer = bytearray(3 * SEND_CHUNK_BYTES)
    body = PartBody(buffer, send_timeout_secs=0.05)
    payload = aiohttp_payload.PAYLOAD_REGISTRY.get(_IOBaseWrapper(body))
    writer = _StuckWriter()
    with pytest.raises(aiohttp.ServerTimeoutError) as caught:
        asyncio.run(payload.write_with_length(writer, None))
    # aiobotocore maps a server timeout whose message does not begin with "connect" to botocore's
    # ReadTimeoutError (retried, then named with the store's read timeout).
    assert str(caught.value) == f"{WRITE_TIMEOUT_MESSAGE}: the connection did not take 256 KiB within 0.05 s"
    assert len(writer.chunks) == 2  # the first was taken; the second never was
    assert body.tell() == 0  # a failed attempt leaves the body rewound as well
    # Without a timeout the same body is sent whole to a connection that drains.
    unbounded = aiohttp_payload.PAYLOAD_REGISTRY.get(_IOBaseWrapper(PartBody(buffer)))
    recorded = _RecordingWriter()
    asyncio.run(unbounded.write_with_length(recorded, None))
    assert sum(chunk.nbytes for chunk in recorded.chunks) == len(buffer)
