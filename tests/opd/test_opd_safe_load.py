"""Safe loading (weights-only with a narrow numpy allow-list) and the save-time sanitiser."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pickle
import threading
import types
import zipfile

import numpy as np
import pytest
import torch
import yaml

from opd_store.errors import UnsafeCheckpointError
from opd_store.opd import load_opd_checkpoint, save_opd_checkpoint
from opd_store.opd._safe_load import ALLOWED_GLOBAL_NAMES, find_unsafe_globals, load_payload, sanitize_state
from opd_store.store import CheckpointStore

EXECUTED: list[str] = []


def _record_execution(tag: str) -> str:
    """What a hostile pickle would call; recording it shows whether loading ran code."""
    EXECUTED.append(tag)
    return tag


class Exploit:
    def __reduce__(self):
        return (_record_execution, ("exploit ran",))


def _write_checkpoint(store: CheckpointStore, opd, trainer_extra) -> None:
    """A committed checkpoint whose training state holds ``trainer_extra`` (written without the
    sanitiser, as a hostile or old writer would)."""
    from opd_store.opd._rng import capture_rng_state

    _layer, optimizer, scheduler = opd.make_training()
    config = opd.TinyConfig()
    with store.begin(2) as txn:
        with txn.open("rng.pt") as writer:
            torch.save(capture_rng_state(), writer)
        with txn.open("training_state.pt") as writer:
            torch.save(
                {
                    "schema": "opd_checkpoint_v1",
                    "trainer": opd.trainer_state(2, extra=trainer_extra),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "config_fingerprint": config.fingerprint(),
                    "provenance_fingerprints": opd.PROVENANCE,
                    "world_size": 1,
                    "teacher": {},
                },
                writer,
            )
        txn.write_bytes("config.yaml", yaml.safe_dump(config.as_dict(), sort_keys=False).encode())


def test_arbitrary_pickled_object_is_refused_and_never_runs(opd_backend, opd):
    store = CheckpointStore(opd_backend.url, storage_options=opd_backend.storage_options)
    _write_checkpoint(store, opd, Exploit())
    EXECUTED.clear()
    with pytest.raises(UnsafeCheckpointError, match="_record_execution") as info:
        load_opd_checkpoint((store, 2), **opd.load_kwargs())
    assert isinstance(info.value, ValueError)
    assert "allow_pickle" in str(info.value)
    assert EXECUTED == []
    if opd_backend.name == "local":
        # The explicit opt-in, for a trusted local directory, does load it (and runs the pickle).
        state = load_opd_checkpoint((store, 2), allow_pickle=True, **opd.load_kwargs())
        assert state["extra"] == "exploit ran" and EXECUTED == ["exploit ran"]
    else:
        with pytest.raises(UnsafeCheckpointError, match="only to checkpoints in a local directory"):
            load_opd_checkpoint((store, 2), allow_pickle=True, **opd.load_kwargs())
        assert EXECUTED == []


def _numpy1_pickle_module() -> types.ModuleType:
    """A pickle module whose Pickler names numpy's reconstructor as numpy 1.x did."""
    from numpy._core.multiarray import _reconstruct

    class Numpy1Pickler(pickle._Pickler):
        def save_global(self, obj, name=None):
            if obj is _reconstruct:
                self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
                self.memoize(obj)
                return
            super().save_global(obj, name)

    module = types.ModuleType("numpy1_pickle")
    module.Pickler = Numpy1Pickler
    module.Unpickler = pickle.Unpickler
    module.load = pickle.load
    module.__name__ = "pickle"
    return module


def _data_pkl(payload: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(payload)) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))


@pytest.mark.parametrize("numpy_names", ["numpy 1.x", "numpy 2.x"])
def test_numpy_rng_state_loads_under_both_reconstructor_names(numpy_names):
    np.random.seed(17)
    state = {"numpy": np.random.get_state(), "key": np.arange(5, dtype=np.uint32)}
    buffer = io.BytesIO()
    if numpy_names == "numpy 1.x":
        torch.save(state, buffer, pickle_module=_numpy1_pickle_module(), pickle_protocol=2)
        assert b"numpy.core.multiarray\n_reconstruct" in _data_pkl(buffer.getvalue())
        assert b"numpy._core" not in _data_pkl(buffer.getvalue())
    else:
        torch.save(state, buffer)
        assert b"numpy._core.multiarray" in _data_pkl(buffer.getvalue())
    payload = buffer.getvalue()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(payload), weights_only=True)  # torch's defaults alone refuse it
    assert find_unsafe_globals(payload) == []
    loaded = load_payload(payload, source="mem://rng.pt")
    assert loaded["numpy"][0] == "MT19937"
    assert np.array_equal(loaded["numpy"][1], state["numpy"][1]) and loaded["numpy"][1].dtype == np.uint32
    assert loaded["numpy"][2:] == state["numpy"][2:]
    assert np.array_equal(loaded["key"], state["key"])
    assert not [g for g in torch.serialization.get_safe_globals() if "numpy" in str(g)]  # removed again


def test_allow_list_is_narrow_and_applied_under_a_lock():
    assert "numpy.core.multiarray._reconstruct" in ALLOWED_GLOBAL_NAMES
    assert "numpy._core.multiarray._reconstruct" in ALLOWED_GLOBAL_NAMES
    assert "numpy.dtypes.UInt32DType" in ALLOWED_GLOBAL_NAMES
    assert "numpy.dtypes.ObjectDType" not in ALLOWED_GLOBAL_NAMES
    assert not any(name.endswith(".scalar") for name in ALLOWED_GLOBAL_NAMES)
    buffer = io.BytesIO()
    torch.save(np.arange(6, dtype=np.float32).reshape(2, 3), buffer)
    payload = buffer.getvalue()
    results, errors = [], []

    def worker():
        try:
            for _ in range(5):
                results.append(load_payload(payload, source="thread"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 20
    assert all(np.array_equal(r, np.arange(6, dtype=np.float32).reshape(2, 3)) for r in results)
    # An object array stays refused.
    buffer = io.BytesIO()
    torch.save(np.array([{"a": 1}], dtype=object), buffer)
    with pytest.raises(UnsafeCheckpointError):
        load_payload(buffer.getvalue(), source="obj")


def test_callers_own_safe_globals_survive_a_load():
    torch.serialization.add_safe_globals([np.ndarray])
    try:
        buffer = io.BytesIO()
        torch.save(np.arange(3), buffer)
        assert np.array_equal(load_payload(buffer.getvalue(), source="x"), np.arange(3))
        assert np.ndarray in torch.serialization.get_safe_globals()
    finally:
        from torch._weights_only_unpickler import _remove_safe_globals

        _remove_safe_globals([np.ndarray])


def test_pickle_only_seed_payload_needs_the_opt_in(tmp_path, opd):
    from seed_layout import PickledNote, write_seed_checkpoint

    _layer, optimizer, scheduler = opd.make_training()
    directory = write_seed_checkpoint(
        checkpoints_dir=tmp_path / "seed",
        model=opd.StubAdapterModel(),
        processor=None,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=opd.trainer_state(2, note=PickledNote("kept by the seed")),
        config=opd.TinyConfig(),
        provenance_fingerprints=opd.PROVENANCE,
        teacher_state={"update_count": 2},
    )
    with pytest.raises(UnsafeCheckpointError, match=r"seed_layout\.PickledNote"):
        load_opd_checkpoint(str(directory), **opd.load_kwargs())
    state = load_opd_checkpoint(str(directory), allow_pickle=True, **opd.load_kwargs())
    assert state["note"] == PickledNote("kept by the seed")


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Point:
    x: int


def test_sanitiser_converts_numpy_values():
    clean = sanitize_state(
        {
            "f": np.float32(0.25),
            "i": np.int64(3),
            "b": np.bool_(True),
            np.int64(4): "numpy key",
            "nested": [(np.float64(1.5), np.uint8(7))],
            "array": np.arange(4, dtype=np.int16).reshape(2, 2),
            "big_endian": np.arange(3, dtype=">f4"),
            "od": collections.OrderedDict(a=np.int32(1)),
            "t": torch.ones(2),
        },
        path="trainer_state",
    )
    assert clean["f"] == 0.25 and type(clean["f"]) is float
    assert clean["i"] == 3 and type(clean["i"]) is int
    assert clean["b"] is True
    assert clean[4] == "numpy key" and type(next(k for k in clean if k == 4)) is int
    assert clean["nested"] == [(1.5, 7)] and type(clean["nested"][0][1]) is int
    assert clean["array"].dtype == torch.int16 and clean["array"].tolist() == [[0, 1], [2, 3]]
    assert clean["big_endian"].dtype == torch.float32 and clean["big_endian"].tolist() == [0.0, 1.0, 2.0]
    assert type(clean["od"]) is collections.OrderedDict and clean["od"] == {"a": 1}
    buffer = io.BytesIO()
    torch.save(clean, buffer)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(buffer.getvalue())) == []


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (object(), "builtins.object"),
        (collections.defaultdict(int), "collections.defaultdict"),
        (Color.RED, "Color"),
        (Point(1), "Point"),
        (collections.namedtuple("Pair", "a b")(1, 2), "Pair"),
        (frozenset({1}), "builtins.frozenset"),
        (np.array(["a"]), "ndarray"),
        (np.datetime64("2020-01-01"), "datetime64"),
    ],
    ids=["object", "defaultdict", "enum", "dataclass", "namedtuple", "frozenset", "str-array", "datetime64"],
)
def test_sanitiser_refuses_what_weights_only_cannot_restore_naming_the_key(value, kind):
    with pytest.raises(UnsafeCheckpointError, match=kind) as info:
        sanitize_state({"extra": {"items": [0, value]}}, path="trainer_state")
    assert "trainer_state['extra']['items'][1]" in str(info.value)


def test_sanitiser_refuses_cycles():
    loop: list = []
    loop.append(loop)
    with pytest.raises(UnsafeCheckpointError, match="cycle"):
        sanitize_state({"loop": loop}, path="teacher_state")


@pytest.mark.parametrize("where", ["trainer_state", "teacher_state"])
def test_unloadable_state_is_refused_at_save_naming_its_key(opd_backend, opd, where):
    store = CheckpointStore(opd_backend.url, storage_options=opd_backend.storage_options)
    kwargs = opd.save_kwargs(store)
    kwargs[where]["cache"] = {"entry": Point(3)}
    with pytest.raises(UnsafeCheckpointError, match=rf"{where}\['cache'\]\['entry'\]"):
        save_opd_checkpoint(**kwargs)
    assert store.checkpoints() == []


def test_gpu_saved_optimizer_state_lands_on_the_parameters_device(tmp_path, monkeypatch, opd):
    """Tensors tagged with a CUDA location load onto CPU parameters (map_location="cpu", then
    Optimizer.load_state_dict moves state to each parameter's device)."""
    store = CheckpointStore(str(tmp_path / "store"))
    kwargs = opd.save_kwargs(store)
    saved_state = kwargs["optimizer"].state_dict()
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_opd_checkpoint(**kwargs)
    raw = store.read(2, "training_state.pt")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(raw), weights_only=True)  # what a naive load would do
    load = opd.load_kwargs()
    load_opd_checkpoint((store, 2), **load)
    restored = load["optimizer"].state_dict()
    for index, param_state in restored["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert param_state[key].device.type == "cpu"
            assert torch.equal(param_state[key], saved_state["state"][index][key])

    # Parameters on another device (meta here; cuda on a GPU host): the state follows them.
    layer = torch.nn.Linear(4, 3, device="meta")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    load.update(optimizer=optimizer, scheduler=scheduler)
    load_opd_checkpoint((store, 2), **load)
    for param_state in optimizer.state_dict()["state"].values():
        assert param_state["exp_avg"].device.type == "meta"
        assert param_state["exp_avg_sq"].device.type == "meta"
