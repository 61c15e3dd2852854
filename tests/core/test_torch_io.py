"""``opd_store.format._torch_io``: torch.save without torch's zip CRC-32, scoped to the calling thread."""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
import zipfile

import pytest
import torch

from opd_store import CheckpointStore, IntegrityError
from opd_store.format import step_dirname, torch_save
from opd_store.format._torch_io import no_zip_crc32, zip_crc32_switchable


def _state() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {"weight": torch.rand(4096, generator=gen), "bias": torch.arange(16, dtype=torch.float32)}


def _save_state(store: CheckpointStore, step: int) -> dict:
    """Commit ``_state()`` as payload ``state.pt`` of ``step`` through ``torch_save``; return it."""
    state = _state()
    with store.begin(step) as txn:
        with txn.open("state.pt") as writer:
            torch_save(state, writer)
    return state


def _record_crcs(data: bytes) -> dict[str, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename.split("/", 1)[1]: info.CRC for info in archive.infolist()}


def test_switchable_on_the_torch_ci_installs():
    # CI installs torch 2.13, whose config overrides are thread-local.
    assert torch.__version__.startswith("2.13")
    assert zip_crc32_switchable() is True


def test_torch_save_writes_no_zip_crc_and_round_trips_through_the_store(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    state = _state()
    with store.begin(3) as txn:
        with txn.open("state.pt") as writer:
            torch_save(state, writer)
    data = store.read(3, "state.pt")
    crcs = _record_crcs(data)
    # Tensor records ("data/0", "data/1") carry CRC 0: torch skipped its CRC-32.
    assert crcs["data/0"] == 0 and crcs["data/1"] == 0
    with store.open(3, "state.pt") as handle:
        loaded = torch.load(handle, weights_only=True)
    assert torch.equal(loaded["weight"], state["weight"])
    assert torch.equal(loaded["bias"], state["bias"])

    plain = io.BytesIO()
    torch.save(state, plain)  # outside the helper: torch's default, real CRC-32s
    assert _record_crcs(plain.getvalue())["data/0"] != 0
    assert zipfile.ZipFile(plain).testzip() is None


def test_store_crc32c_catches_what_the_missing_zip_crc_would_have(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    state = _save_state(store, 1)
    entry = store.manifest(1).entry("state.pt")
    path = tmp_path / "store" / step_dirname(1) / entry.path
    data = bytearray(path.read_bytes())
    offset = data.index(state["weight"][100:104].numpy().tobytes())
    data[offset] ^= 0x01  # one bit of one float in the weight record
    path.write_bytes(bytes(data))
    # torch.load alone accepts the damaged archive (no zip CRC to check) and returns a wrong value...
    loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert not torch.equal(loaded["weight"], state["weight"])
    # ...the store's CRC32C refuses it.
    with pytest.raises(IntegrityError, match="crc32c"):
        store.open(1, "state.pt")


def test_no_zip_crc32_does_not_reach_other_threads():
    inside = threading.Event()
    release = threading.Event()
    seen: dict[str, object] = {}

    def holder() -> None:
        with no_zip_crc32():
            seen["holder"] = torch.serialization.get_crc32_options()
            inside.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        seen["other"] = torch.serialization.get_crc32_options()
        buffer = io.BytesIO()
        torch.save(_state(), buffer)  # this thread, while the holder is inside the block
    finally:
        release.set()
        thread.join(timeout=60)
    assert seen == {"holder": False, "other": True}
    assert _record_crcs(buffer.getvalue())["data/0"] != 0
    assert zipfile.ZipFile(buffer).testzip() is None
    assert torch.serialization.get_crc32_options() is True


def _mapped_from(tensor: torch.Tensor, path) -> bool:
    """Whether the tensor's data lies in a mapping of ``path`` (from /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_torch_load_maps_a_verified_local_payload_privately(tmp_path):
    from opd_store.format import torch_load

    store = CheckpointStore(tmp_path / "store")
    state = _save_state(store, 5)
    entry = store.manifest(5).entry("state.pt")
    path = tmp_path / "store" / step_dirname(5) / entry.path
    on_disk = path.read_bytes()
    with store.open(5, "state.pt") as handle:
        mapped = torch_load(handle, mmap=True)
        copied = torch_load(handle, mmap=False) if handle.seek(0) == 0 else None
    assert torch.equal(mapped["weight"], state["weight"]) and torch.equal(copied["weight"], state["weight"])
    # The mapped storage is file-backed: its bytes are the file's bytes, at the file's offset.
    weight_bytes = state["weight"].numpy().tobytes()
    assert _mapped_from(mapped["weight"], path) and not _mapped_from(copied["weight"], path)
    # Private mapping: writing the loaded tensor changes neither the file nor a new load.
    mapped["weight"][:8] = -1.0
    assert path.read_bytes() == on_disk and on_disk.count(weight_bytes) == 1
    with store.open(5, "state.pt") as handle:
        again = torch_load(handle, mmap=True)
    assert torch.equal(again["weight"], state["weight"])
    # Deleting the step (unlink) leaves a live mapping readable.
    store.delete(5)
    assert not path.exists()
    assert torch.equal(again["bias"], state["bias"])


def test_torch_load_mmap_of_a_remote_payload_loads_from_memory():
    import fsspec

    from opd_store.format import torch_load

    fsspec.filesystem("memory").store.clear()
    store = CheckpointStore("memory://torch-io/run")
    state = _save_state(store, 2)
    with store.open(2, "state.pt") as handle:
        loaded = torch_load(handle, mmap=True)
    assert torch.equal(loaded["weight"], state["weight"])
    assert not any(line.rstrip().endswith("state.pt") for line in open("/proc/self/maps"))
    fsspec.filesystem("memory").store.clear()


def _address_range(buffer: bytearray) -> tuple[int, int]:
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    return start, start + len(buffer)


@pytest.mark.parametrize("name", ["s3", "gcs"])
def test_a_downloaded_payload_loads_in_place_as_views_of_its_one_buffer(name, request):
    from opd_store.format import torch_load

    backend = request.getfixturevalue(f"{name}_backend")
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    state = _save_state(store, 4)
    with store.open(4, "state.pt") as handle:
        buffer = handle.lendable_buffer()
        assert isinstance(buffer, bytearray) and len(buffer) == store.manifest(4).entry("state.pt").size_bytes
        first, end = _address_range(buffer)
        loaded = torch_load(handle)  # mmap=False: a remote payload is loaded in place either way
    assert handle.lendable_buffer() is None  # closed: lends nothing more
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor)
        offset = loaded[key].data_ptr() - first
        # No copy: the tensor's memory is the downloaded buffer, at its record's bytes.
        assert 0 <= offset and first + offset + tensor.nbytes <= end
        assert bytes(buffer[offset:offset + tensor.nbytes]) == tensor.numpy().tobytes()
    # Ordinary writable memory: writing a loaded tensor changes neither the store nor a new load.
    loaded["weight"][:4] = -1.0
    assert buffer[loaded["weight"].data_ptr() - first:][:4] == torch.tensor([-1.0]).numpy().tobytes()
    with store.open(4, "state.pt") as handle:
        again = torch_load(handle)
    assert torch.equal(again["weight"], state["weight"])
    del buffer, handle
    assert torch.equal(loaded["bias"], state["bias"])  # the tensors keep the memory alive


def test_in_place_load_only_from_a_reader_that_lends_its_buffer():
    from opd_store.format import weights_only_load
    from opd_store.storage.transfers import MemoryReader

    state = _state()
    data = io.BytesIO()
    torch_save(state, data)
    pooled = bytearray(data.getvalue())  # a reused buffer (an upload part): never lent
    loaded = weights_only_load(MemoryReader(pooled))
    first, end = _address_range(pooled)
    assert torch.equal(loaded["weight"], state["weight"])
    assert not first <= loaded["weight"].data_ptr() < end
    # Read from the middle: not at an archive's start, so torch.load decides (and refuses).
    reader = MemoryReader(bytearray(data.getvalue()), lend_buffer=True)
    reader.seek(1)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        weights_only_load(reader)


@dataclasses.dataclass
class _NotAllowed:
    value: int


def test_in_place_load_refuses_an_unsafe_payload_in_torch_words():
    from opd_store.format import weights_only_load
    from opd_store.storage.transfers import MemoryReader

    data = io.BytesIO()
    torch.save({"weight": torch.ones(3), "odd": _NotAllowed(1)}, data)
    with pytest.raises(pickle.UnpicklingError) as refused:
        weights_only_load(MemoryReader(bytearray(data.getvalue()), lend_buffer=True))
    with pytest.raises(pickle.UnpicklingError) as by_torch:
        torch.load(io.BytesIO(data.getvalue()), weights_only=True)
    assert str(refused.value) == str(by_torch.value)
    assert "Weights only load failed" in str(refused.value) and "_NotAllowed" in str(refused.value)


def test_the_opd_layers_safe_load_loads_a_downloaded_payload_in_place():
    from opd_store.opd._safe_load import load_payload
    from opd_store.storage.transfers import MemoryReader

    state = {"model": _state(), "rng": torch.get_rng_state(), "step": 9}
    data = io.BytesIO()
    torch.save(state, data)
    buffer = bytearray(data.getvalue())
    loaded = load_payload(MemoryReader(buffer, lend_buffer=True), source="s3://bucket/run/step-000009/state.pt")
    first, end = _address_range(buffer)
    assert loaded["step"] == 9 and torch.equal(loaded["rng"], state["rng"])
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert first <= loaded["model"]["weight"].data_ptr() < end and first <= loaded["rng"].data_ptr() < end


def test_a_downloaded_payload_in_an_older_format_loads_as_torch_load_reads_it():
    from opd_store.errors import UnsafeCheckpointError
    from opd_store.format import weights_only_load
    from opd_store.opd._safe_load import load_payload
    from opd_store.storage.transfers import MemoryReader

    legacy = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, legacy, _use_new_zipfile_serialization=False)  # no zip archive
    loaded = weights_only_load(MemoryReader(bytearray(legacy.getvalue()), lend_buffer=True))
    assert torch.equal(loaded["w"], torch.arange(4.0))
    plain = pickle.dumps({"w": [1, 2]})  # a seed-era pickle: refused by the OPD loader, as from bytes
    with pytest.raises(UnsafeCheckpointError, match="weights-only loading cannot restore"):
        load_payload(MemoryReader(bytearray(plain), lend_buffer=True), source="s3://b/run/step-000001/x.pt")
    with pytest.raises(UnsafeCheckpointError, match="weights-only loading cannot restore"):
        load_payload(plain, source="s3://b/run/step-000001/x.pt")
