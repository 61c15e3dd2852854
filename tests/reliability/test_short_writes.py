"""A backend that reports success for a write but stores 0 bytes or a
short object. The commit lists the attempt prefix once before creating the manifest and refuses a
payload whose stored size differs from the bytes written: the step never counts as complete, the
previous step stays the latest, and the save reports the failure instead of success."""

from __future__ import annotations

import pytest
from core.helpers import open_store, save

from opd_store import CheckpointStore
from opd_store.errors import IncompleteCheckpointError
from opd_store.testing import FaultyStorage, FaultyWriter


class _ShortHandle:
    """A writer that reports every byte written but passes on only the first ``keep_bytes``."""

    def __init__(self, inner, keep_bytes: int) -> None:
        self._inner = inner
        self._keep_bytes = keep_bytes
        self._seen = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        room = max(0, self._keep_bytes - self._seen)
        if room:
            self._inner.write(view[:room])
        self._seen += view.nbytes
        return view.nbytes

    def __getattr__(self, name):
        return getattr(self._inner, name)


class ShortWriteStorage(FaultyStorage):
    """Stores only ``keep_bytes`` of the payloads whose name is in ``short_names``."""

    def __init__(self, inner, short_names, keep_bytes: int) -> None:
        super().__init__(inner)
        self.short_names = set(short_names)
        self.keep_bytes = keep_bytes

    def open_write(self, rel: str, **kwargs):
        handle = self.inner.open_write(rel, **kwargs)
        if rel.rsplit("/", 1)[-1] in self.short_names:
            handle = _ShortHandle(handle, self.keep_bytes)
        return FaultyWriter(self, handle, rel)


@pytest.mark.parametrize("backend", ["local", "memory", "s3", "gcs"], indirect=True)
@pytest.mark.parametrize("keep_bytes", [0, 100])
def test_a_short_stored_payload_is_never_committed(backend, raw, keep_bytes):
    store = open_store(backend)
    save(store, 1, {"model.bin": b"one" * 100})
    short = ShortWriteStorage(store.storage, {"model.bin"}, keep_bytes)
    payload = bytes(range(256)) * 4
    with pytest.raises(IncompleteCheckpointError) as caught:
        save(CheckpointStore.from_storage(short), 2, {"config.json": b"{}", "model.bin": payload})
    message = str(caught.value)
    assert "step 2 not committed" in message
    assert f"model.bin: wrote {len(payload)} bytes, backend holds {keep_bytes} bytes" in message
    assert "config.json" not in message  # only the short object is named
    # One listing of the attempt between the sync and the (never made) create.
    kinds = [op.kind for op in short.ops if op.kind in ("list", "sync", "create", "delete_tree")]
    assert kinds == ["sync", "list", "delete_tree"]
    assert store.steps() == [1]
    assert store.latest_step() == 1
    assert store.status(2) == "uncommitted"
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []
    assert store.read(1, "model.bin") == b"one" * 100


def test_the_size_check_is_one_listing_per_commit(local_backend):
    store = open_store(local_backend)
    spy = FaultyStorage(store.storage)
    save(CheckpointStore.from_storage(spy), 3, {f"part-{i}.bin": bytes(i) for i in range(5)})
    tail = [op.kind for op in spy.ops if op.kind in ("list", "sync", "create")]
    assert tail == ["sync", "list", "create"]
    assert store.is_complete(3)
