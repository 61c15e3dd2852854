"""``opd_store.format._checksum``: CRC32C (awscrt) over every buffer type a writer is handed, checked against
the published check value and against a second implementation (the ``crc32c`` package)."""

from __future__ import annotations

import crc32c
import numpy as np
import torch

from opd_store.format import Crc32c, crc32c_hex
from opd_store.format._checksum import ALGORITHM


def test_the_published_check_value():
    # CRC-32C (Castagnoli) of b"123456789" is 0xE3069283 (RFC 3720, appendix B.4).
    assert crc32c_hex(b"123456789") == "e3069283"
    assert crc32c_hex(b"") == "00000000"
    assert ALGORITHM == "crc32c"


def test_streaming_over_every_buffer_type_equals_the_crc32c_package():
    tensor = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB of writable tensor storage
    storage = memoryview(tensor.numpy()).cast("B")
    pieces = [b"header", bytearray(b"\x00" * 4096), storage[:3], storage[3:1 << 21], storage[1 << 21:],
              memoryview(np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2])]  # not contiguous: copied
    hasher = Crc32c()
    fed = [hasher.update(piece) for piece in pieces]
    whole = b"".join(bytes(memoryview(piece).tobytes()) for piece in pieces)
    assert fed == [6, 4096, 3, (1 << 21) - 3, (4 << 20) - (1 << 21), 48]
    assert hasher.size_bytes == len(whole)
    assert hasher.hexdigest() == f"{crc32c.crc32c(whole):08x}"
