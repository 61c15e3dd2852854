"""Local payload writes reach the file in slices of at most 512 KiB (``LocalStorage.write_slice_bytes``).

Whole-tensor writes of 2 MiB or more cost 15-20x the CPU on Linux 6.18 page caches
(``python -m bench.write_size``); the slices must still produce the exact bytes and CRC32C.
"""

from __future__ import annotations

import os

import torch

from opd_store import CheckpointStore
from opd_store.format import crc32c_hex, step_dirname, torch_save
from opd_store.storage import _backends as backends


class _RecordingRaw:
    """Wraps the file under ``_FsyncingFile`` and records the size of each write it is handed."""

    def __init__(self, raw, sizes: list[int]) -> None:
        self._raw = raw
        self._sizes = sizes

    def write(self, data) -> int:
        self._sizes.append(memoryview(data).nbytes)
        return self._raw.write(data)

    def __getattr__(self, name):
        return getattr(self._raw, name)


def test_large_writes_are_sliced_and_bytes_and_crc_are_exact(tmp_path, monkeypatch):
    sizes: list[int] = []
    real_init = backends._FsyncingFile.__init__

    def recording_init(self, path):
        real_init(self, path)
        self._file = _RecordingRaw(self._file, sizes)

    monkeypatch.setattr(backends._FsyncingFile, "__init__", recording_init)
    store = CheckpointStore(tmp_path / "store")
    blob = os.urandom(3 * 2**20 + 12345)  # one 3 MiB + 12,345-byte write: 7 slices
    tensor = torch.arange(2**20, dtype=torch.float32)  # a 4 MiB storage handed over by torch.save
    with store.begin(1) as txn:
        with txn.open("blob.bin") as writer:
            writer.write(memoryview(blob))
        with txn.open("state.pt") as writer:
            torch_save({"t": tensor}, writer)
    assert backends.LocalStorage.write_slice_bytes == 512 * 1024 and store.storage.write_slice_bytes == 512 * 1024
    assert sizes and max(sizes) == 512 * 1024
    assert sizes[:7] == [512 * 1024] * 6 + [len(blob) - 6 * 512 * 1024]
    entry = store.manifest(1).entry("blob.bin")
    on_disk = (tmp_path / "store" / step_dirname(1) / entry.path).read_bytes()
    assert on_disk == blob and entry.size_bytes == len(blob) and entry.crc32c == crc32c_hex(blob)
    with store.open(1, "state.pt") as handle:
        assert torch.equal(torch.load(handle, weights_only=True)["t"], tensor)

