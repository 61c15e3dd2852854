"""RNG capture/restore, and saves that leave every global generator exactly as they found it."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from opd_store.opd import _rng as rng_module
from opd_store.opd import load_opd_checkpoint, preserve_global_rng, save_opd_checkpoint
from opd_store.opd._rng import capture_rng_state, restore_rng_state
from opd_store.store import CheckpointStore


def test_capture_restore_is_exact_and_weights_only_loadable_without_allow_list(opd):
    opd.seed_all(11)
    np.random.randn(3)  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)
    state = capture_rng_state()
    expected = opd.next_draws()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(buffer) == []
    buffer.seek(0)
    assert not [g for g in torch.serialization.get_safe_globals() if "numpy" in str(g)]
    loaded = torch.load(buffer, weights_only=True)  # torch's defaults only
    assert loaded["numpy"]["key"].dtype == torch.int64 and loaded["numpy"]["key"].shape == (624,)
    assert loaded["torch"].dtype == torch.uint8
    opd.seed_all(99)
    restore_rng_state(loaded)
    assert opd.next_draws() == expected


def test_restore_accepts_the_seed_format():
    from seed_layout import seed_rng_state

    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = seed_rng_state()
    assert isinstance(state["numpy"], tuple)
    expected = (random.random(), np.random.rand(2).tobytes(), torch.rand(2).numpy().tobytes())
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    restore_rng_state(state)
    assert (random.random(), np.random.rand(2).tobytes(), torch.rand(2).numpy().tobytes()) == expected


def test_restore_refuses_unknown_format_and_non_mapping():
    with pytest.raises(ValueError, match="unknown RNG state format"):
        restore_rng_state({"format": "other"})
    with pytest.raises(ValueError, match="mapping"):
        restore_rng_state([1, 2])


def test_preserve_global_rng_undoes_draws_even_when_the_body_raises(opd):
    opd.seed_all(5)
    before = opd.rng_fingerprint()
    with preserve_global_rng():
        opd.next_draws()
    assert opd.rng_fingerprint() == before
    with pytest.raises(RuntimeError):
        with preserve_global_rng():
            opd.next_draws()
            raise RuntimeError("boom")
    assert opd.rng_fingerprint() == before


class _FakeCuda:
    """Stands in for torch.cuda's generator API with ``count`` devices (CPU-only host)."""

    def __init__(self, count: int) -> None:
        self.states = [torch.full((16,), device, dtype=torch.uint8) for device in range(count)]
        self.set_calls: list[tuple[int, bytes]] = []
        self.count = count

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [self._set(s, i) for i, s in enumerate(states)])

    def _set(self, state, device=0):
        self.set_calls.append((device, bytes(state.numpy())))
        self.states[device] = state.clone()


def test_every_cuda_device_is_captured_and_restored(monkeypatch):
    fake = _FakeCuda(2)
    fake.install(monkeypatch)
    state = capture_rng_state()
    assert [bytes(s.numpy()) for s in state["cuda"]] == [bytes([0] * 16), bytes([1] * 16)]
    fake.states = [torch.zeros(16, dtype=torch.uint8) + 9, torch.zeros(16, dtype=torch.uint8) + 9]
    restore_rng_state(state)
    assert fake.set_calls == [(0, bytes([0] * 16)), (1, bytes([1] * 16))]

    fewer = _FakeCuda(1)
    fewer.install(monkeypatch)
    with pytest.warns(RuntimeWarning, match="2 CUDA generator state.*1 device"):
        restore_rng_state(state)
    assert fewer.set_calls == [(0, bytes([0] * 16))]

    fake = _FakeCuda(2)
    fake.install(monkeypatch)
    with preserve_global_rng():
        fake.states = [torch.zeros(16, dtype=torch.uint8) + 7] * 2  # a draw on each device
    assert [bytes(s.numpy()) for s in fake.states] == [bytes([0] * 16), bytes([1] * 16)]


def test_cuda_states_are_skipped_with_a_warning_without_cuda(monkeypatch, opd):
    monkeypatch.setattr(rng_module, "_cuda_available", lambda: False)
    opd.seed_all(1)
    state = capture_rng_state()
    assert "cuda" not in state
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    expected = opd.next_draws()
    opd.seed_all(2)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        restore_rng_state(state)
    assert opd.next_draws() == expected  # CPU generators restored all the same


def _drawing(op) -> bool:
    """A fault predicate that never fails but draws from every generator, as retry back-off does."""
    random.random()
    np.random.rand()
    torch.rand(1)
    return False


@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_save_leaves_generators_untouched_when_the_storage_draws(request, tmp_path, opd, backend_name):
    from opd_store.testing import Fault, FaultyStorage

    url = str(tmp_path / "store") if backend_name == "local" else "memory://opd-test/rng"
    draws = Fault(when=_drawing, once=False)
    storage = FaultyStorage(CheckpointStore(url).storage, draws, before_create=lambda *args: _drawing(None))
    store = CheckpointStore.from_storage(storage)
    kwargs = opd.save_kwargs(store)  # builds a Linear layer: draws from torch
    opd.seed_all(21)
    before = opd.rng_fingerprint()
    save_opd_checkpoint(**kwargs)
    assert opd.rng_fingerprint() == before
    assert any(op.kind == "write" for op in storage.ops)  # the storage did draw, many times
    expected = opd.next_draws()

    opd.seed_all(0)
    load_opd_checkpoint((CheckpointStore(url), 2), **opd.load_kwargs())
    assert opd.next_draws() == expected  # the saved state is the one the save was called with

    # A save that fails (injected fault at the commit) leaves them untouched too.
    failing = FaultyStorage(CheckpointStore(url).storage, Fault(when=lambda op: _drawing(op) or op.kind == "create"))
    kwargs = opd.save_kwargs(CheckpointStore.from_storage(failing), successful=3)
    before = opd.rng_fingerprint()
    with pytest.raises(OSError):
        save_opd_checkpoint(**kwargs)
    assert opd.rng_fingerprint() == before


def test_s3_retries_during_save_leave_generators_untouched(s3_fault_proxy, opd):
    backend, proxy = s3_fault_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)

    # Control: outside a save, botocore's retry back-off does move Python's generator.
    opd.seed_all(8)
    before = random.getstate()
    proxy.fail_puts = 1
    with store.begin(1) as txn:
        txn.write_bytes("probe.bin", b"probe")
    assert len(proxy.failed) == 1
    assert random.getstate() != before

    kwargs = opd.save_kwargs(store)
    opd.seed_all(9)
    before = opd.rng_fingerprint()
    proxy.failed.clear()
    proxy.fail_puts = 2
    url = save_opd_checkpoint(**kwargs)
    assert len(proxy.failed) == 2  # two PUTs answered 503 and retried by botocore
    assert opd.rng_fingerprint() == before
    expected = opd.next_draws()
    assert store.status(2) == "complete"
    opd.seed_all(0)
    load_opd_checkpoint((store, 2), **opd.load_kwargs())
    assert opd.next_draws() == expected
    assert url == store.step_url(2)
