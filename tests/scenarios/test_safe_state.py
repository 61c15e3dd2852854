"""Integrity and safe loading: training state holding config-like objects,
numpy scalars and counters is converted to plain types or refused at save time with its key
named; whatever was saved loads under ``torch.load(weights_only=True)``, with no allow-list."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pathlib
import types
from collections.abc import MutableMapping, Sequence

import numpy as np
import pydantic
import torch

from opd_store.errors import UnsafeCheckpointError
from opd_store.opd._safe_load import ALLOWED_GLOBALS

from .helpers import base_state, config, load, save, student, trainable


@dataclasses.dataclass
class RunConfig:
    lr: float = 0.1
    path: str = "/data"


class PydanticConfig(pydantic.BaseModel):
    lr: float = 0.1


class DictConfigLike(MutableMapping):
    """What OmegaConf's ``DictConfig`` is to Python: a mutable mapping that is not a dict."""

    def __init__(self, **items) -> None:
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value

    def __delitem__(self, key) -> None:
        del self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class ListConfigLike(Sequence):
    def __init__(self, *items) -> None:
        self._items = list(items)

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


class AttrDict(dict):
    pass


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 2


class Mode(str, enum.Enum):
    TRAIN = "train"


Point = collections.namedtuple("Point", "x y")

# (value, hint the error must give)
REFUSED = {
    "dataclass": (RunConfig(), "dataclasses.asdict"),
    "pydantic": (PydanticConfig(), "model_dump"),
    "omegaconf_like_mapping": (DictConfigLike(lr=0.1), "OmegaConf.to_container"),
    "omegaconf_like_sequence": (ListConfigLike(1, 2), "plain list"),
    "mapping_proxy": (types.MappingProxyType({"a": 1}), "plain dict"),
    "dict_subclass": (AttrDict(a=1), "dict(value)"),
    "defaultdict": (collections.defaultdict(int, a=1), "dict(value)"),
    "enum": (Color.RED, "value.value"),
    "int_enum": (Level.HIGH, "value.value"),
    "str_enum": (Mode.TRAIN, "value.value"),
    "path": (pathlib.Path("/data/run"), "str(path)"),
    "pure_path": (pathlib.PurePosixPath("a/b"), "str(path)"),
    "namedtuple": (Point(1, 2), "_asdict"),
    "generator": (torch.Generator().manual_seed(1), "get_state()"),
    "datetime64": (np.datetime64("2026-01-01"), "no plain equivalent"),
    "object": (object(), "store plain Python values"),
}


def _refused(save_call, named: str, hint: str) -> None:
    try:
        save_call()
    except UnsafeCheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{named} was saved instead of refused")
    assert message.startswith(named + " holds a "), message
    assert hint in message, message


def test_config_like_state_is_refused_naming_its_key(store, backend):
    """Dataclasses, pydantic models, OmegaConf-like mappings and sequences, dict
    subclasses, enums, paths, namedtuples, generators and numpy datetimes in trainer or teacher
    state (as values or as keys, at any depth) are refused at save time; the error names the key
    path and how to convert the value; nothing is written to the store."""
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def attempt(trainer, teacher=None):
        return lambda: save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=trainer,
                            teacher_state=teacher if teacher is not None else {"update_count": 4})

    for kind, (value, hint) in REFUSED.items():
        _refused(attempt(base_state(4, config=value)), "trainer_state['config']", hint)
        _refused(attempt(base_state(4, run={"history": [1, {"cfg": value}]})),
                 "trainer_state['run']['history'][1]['cfg']", hint)
        _refused(attempt(base_state(4), {"update_count": 4, "teacher_cfg": value}), "teacher_state['teacher_cfg']", hint)
    _refused(attempt(base_state(4, by_color={Color.RED: 1})), "trainer_state['by_color'] key <Color.RED: 1>", "value.value")
    _refused(attempt(base_state(4, files={pathlib.Path("a"): 1})), "trainer_state['files'] key PosixPath('a')", "str(path)")
    assert store.checkpoints() == []
    fs, root = backend.raw_fs(), backend.raw_root()
    assert not fs.exists(root) or fs.find(root) == []


class _ConfigWith:
    """A config whose ``as_dict()`` holds one value (the seed's duck type)."""

    def __init__(self, value) -> None:
        self.value = value
        self.checkpoint = types.SimpleNamespace(resume_mode="exact")

    def as_dict(self) -> dict:
        return {"data": {"root": self.value}}

    def fingerprint(self) -> str:
        return "fixed"


def test_config_dict_with_objects_is_refused_or_converted(store, backend):
    """``config.as_dict()`` goes to ``config.yaml``; a path, an enum or a dataclass
    there is refused with its key named (``yaml.safe_dump`` would raise an untyped error naming no
    key), a numpy scalar is converted, and nothing is written when refused."""
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for value, hint in ((pathlib.Path("/data"), "str(path)"), (Color.RED, "value.value"), (RunConfig(), "asdict")):
        _refused(lambda: save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(1),
                              cfg=_ConfigWith(value)),
                 "config.as_dict()['data']['root']", hint)
    _refused(lambda: save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(1),
                          cfg=_ConfigWith({1: "int key"})),
             "config.as_dict()['data']['root'] key 1", "keys must be str")
    assert store.checkpoints() == []
    save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(1),
         cfg=_ConfigWith(np.float32(0.5)))
    assert store.read(1, "config.yaml") == b"data:\n  root: 0.5\n"


def _wide_state() -> dict:
    """Every kind the sanitiser keeps or converts, plus counters."""
    return base_state(
        5,
        global_step=5, teacher_updates=5, tokens_seen=2**53 + 1,
        np_float32=np.float32(0.1), np_float64=np.float64(1e-300), np_int=np.int64(-7), np_bool=np.bool_(True),
        np_str=np.str_("tag"), np_array=np.arange(6, dtype=np.int16).reshape(2, 3),
        plain={"none": None, "float": float("inf"), "complex": 1 + 2j, "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"),
               "tuple": (1, "a"), "set": {1, 2}, "counter": collections.Counter(a=3),
               "ordered": collections.OrderedDict(b=1, a=2)},
        torch_atoms=[torch.Size([2, 3]), torch.bfloat16, torch.device("cpu")],
        tensors={"bf16": torch.ones(2, dtype=torch.bfloat16), "sparse": torch.eye(3).to_sparse(),
                 "view": torch.arange(10)[2:5], "param": torch.nn.Parameter(torch.ones(2))},
    )


def test_saved_state_loads_weights_only_without_allow_list(store):
    """Numpy scalars become the equal Python value, numpy arrays tensors, counters
    stay ints; every ``.pt`` payload of the checkpoint loads with plain
    ``torch.load(weights_only=True)`` (no opd_store allow-list) and names no unsafe global."""
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    url = save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=_wide_state(),
               teacher_state={"update_count": 5, "ema": np.float32(0.25), "seen": np.int32(9)})
    payloads = [name for name in store.names(5) if name.endswith((".pt", ".bin"))]
    assert sorted(payloads) == ["rng.pt", "training_state.pt"]
    # opd_store's own allow-list is only in force during its loads: the checks below use torch's alone.
    assert not [entry for entry in ALLOWED_GLOBALS if entry in torch.serialization.get_safe_globals()]
    for name in payloads:
        data = store.read(5, name)
        assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)) == [], name
        torch.load(io.BytesIO(data), weights_only=True)
    raw = torch.load(io.BytesIO(store.read(5, "training_state.pt")), weights_only=True)
    assert raw["teacher"] == {"update_count": 5, "ema": 0.25, "seen": 9} and type(raw["teacher"]["seen"]) is int

    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = load(url, model=model, optimizer=optimizer, scheduler=scheduler, storage_options=store.storage_options)
    expected = _wide_state()
    assert set(state) == set(expected)
    assert (type(state["np_float32"]), state["np_float32"]) == (float, float(np.float32(0.1)))
    assert (type(state["np_float64"]), state["np_float64"]) == (float, 1e-300)
    assert (type(state["np_int"]), state["np_int"]) == (int, -7)
    assert (type(state["np_bool"]), state["np_bool"]) == (bool, True)
    assert (type(state["np_str"]), state["np_str"]) == (str, "tag")
    assert state["np_array"].dtype == torch.int16 and state["np_array"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert state["tokens_seen"] == 2**53 + 1 and type(state["tokens_seen"]) is int
    for key, value in expected["plain"].items():
        assert state["plain"][key] == value and type(state["plain"][key]) is type(value), key
    assert state["torch_atoms"] == expected["torch_atoms"]
    for key, value in expected["tensors"].items():
        got = state["tensors"][key]
        assert type(got) is type(value) and got.dtype == value.dtype, key
        assert torch.equal(got.to_dense() if got.is_sparse else got, value.to_dense() if value.is_sparse else value.detach())
    assert config().fingerprint()  # the real pydantic config saved alongside
