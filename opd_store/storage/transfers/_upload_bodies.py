"""How an upload request's body reaches the connection: :class:`PartBody`, a reader over a part
buffer that aiohttp (under s3fs's aiobotocore and under gcsfs) sends as views of that buffer, each
handed over within a send timeout.

A ``bytes`` body would be copied whole into asyncio's transport buffer while the socket drains (a
second copy of every part in flight), and aiohttp's generic file payload copies each 256 KiB
through a thread-pool ``read`` (in a 256 MiB save: 1,024 thread hops and a copy of every byte;
docs/performance.md). :class:`_PartPayload`, registered with aiohttp for :class:`PartBody` alone (no
other body of the process changes), hands the connection :data:`SEND_CHUNK_BYTES` views instead.

The send timeout closes a gap of aiohttp's: its read timeout (``sock_read``, which botocore's
``read_timeout`` and gcsfs's ``requests_timeout`` become) starts only once the whole body is
written, and nothing bounds the writing. An endpoint that accepts a connection and then stops
reading (a stuck gateway, a peer whose receive window stays shut) would hold a save forever once the
socket buffers are full. Each chunk must be taken by the connection within ``send_timeout_secs``
(the store's ``read_timeout_secs``); if it is not, the attempt fails with
``aiohttp.ServerTimeoutError``, which the clients treat as they treat a read timeout: botocore
retries it as a ``ReadTimeoutError``, gcsfs as a client error, and opd_store names the endpoint and
the timeout once the retries are spent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import payload as aiohttp_payload

from ._parts import MemoryReader

SEND_CHUNK_BYTES = 256 << 10
"""Bytes handed to the connection at a time (aiohttp's own chunk size); the transport copies at
most the unsent rest of one chunk, then waits for the socket to drain."""

WRITE_TIMEOUT_MESSAGE = "Timeout on writing the request body"
"""How a send timeout's ``aiohttp.ServerTimeoutError`` begins (aiobotocore maps a server timeout
whose message does not begin with "connect" to botocore's ``ReadTimeoutError``)."""


class PartBody(MemoryReader):
    """The body of one upload request: a reader over a part buffer (``bytearray`` or
    ``memoryview``) that aiohttp sends as views of the buffer (:class:`_PartPayload`), with no copy
    and no thread hop. Every request made with it sends the whole buffer, and an attempt leaves it
    rewound however it ends: botocore rewinds a body before its own retries, but s3fs's retry loop
    around botocore calls the operation again with the body as the failed attempt left it, and
    botocore takes a body's length from its position (half read: a ``Content-Length`` of the rest,
    a part of the wrong size). aiohttp never closes it, so one body serves every attempt of its
    request.

    Args:
        buffer: the bytes to send (not copied; kept unchanged until the request has settled).
        send_timeout_secs (float | None): the longest wait for the connection to take one chunk
            (seconds); ``None``: no bound.
    """

    def __init__(self, buffer: Any, *, send_timeout_secs: float | None = None) -> None:
        super().__init__(buffer)
        self.send_timeout_secs = send_timeout_secs


class _PartPayload(aiohttp_payload.Payload):
    """aiohttp's payload for a :class:`PartBody`: its whole buffer as slices, from the start for
    every request (and for a request sent again, such as a redirect)."""

    def __init__(self, value: PartBody, *args: Any, **kwargs: Any) -> None:
        super().__init__(value, *args, **kwargs)
        self._size = value.seek(0, 2)
        value.seek(0)

    @property
    def size(self) -> int:
        return self._size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        self._value.seek(0)
        return self._value.read(self._size).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        """Send the body (at most ``content_length`` bytes).

        Raises:
            aiohttp.ServerTimeoutError: the connection did not take a chunk within the body's
                ``send_timeout_secs`` (the message begins with :data:`WRITE_TIMEOUT_MESSAGE`).
        """
        body = self._value
        timeout_secs = body.send_timeout_secs
        body.seek(0)
        remaining = self._size if content_length is None else min(self._size, content_length)
        try:
            while remaining > 0:
                chunk = body.read_view(min(SEND_CHUNK_BYTES, remaining))
                if not chunk.nbytes:
                    return
                if timeout_secs is None:
                    await writer.write(chunk)
                else:
                    await _within(writer.write(chunk), timeout_secs)
                remaining -= chunk.nbytes
        finally:
            body.seek(0)  # for the next attempt, whoever makes it (see PartBody)


async def _within(write: Any, timeout_secs: float) -> None:
    """Await ``write``; past ``timeout_secs``, cancel it and raise ``aiohttp.ServerTimeoutError``."""
    try:
        if hasattr(asyncio, "timeout"):  # Python 3.11+: no task per chunk
            async with asyncio.timeout(timeout_secs):
                await write
        else:
            await asyncio.wait_for(write, timeout_secs)
    except (asyncio.TimeoutError, TimeoutError):
        raise aiohttp.ServerTimeoutError(f"{WRITE_TIMEOUT_MESSAGE}: the connection did not take "
                                         f"{SEND_CHUNK_BYTES >> 10} KiB within {timeout_secs:g} s") from None


aiohttp_payload.PAYLOAD_REGISTRY.register(_PartPayload, PartBody, order=aiohttp_payload.Order.try_first)

__all__ = ["PartBody", "SEND_CHUNK_BYTES", "WRITE_TIMEOUT_MESSAGE"]
