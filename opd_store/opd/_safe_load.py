"""Loading checkpoint payloads without running code, and keeping unloadable state out of them.

Every payload loads with ``torch.load(weights_only=True, map_location="cpu")``. Allow-listed
beyond torch's defaults, because seed checkpoints hold numpy's RNG state (a ``uint32`` ndarray):
numpy's array reconstructor under its 1.x and 2.x names, ``ndarray``, ``dtype``, and the plain
numeric dtype classes (unpickling a dtype ends in a ``BUILD`` on e.g. ``UInt32DType``). torch's
allow-list is process-wide, so missing entries are added only for a load, under
:data:`_ALLOW_LIST_LOCK`. ``allow_pickle`` (local stores only) falls back to plain pickle.
:func:`sanitize_state` converts or refuses at save time what weights-only loading cannot take
(field notes: "weights-only loading rejects training-state objects"). docs/resume.md, "Safe
loading" and "What trainer state may hold".
"""

from __future__ import annotations

import collections
import collections.abc
import io
import pickle
import threading
from typing import Any, BinaryIO

import numpy as np
import torch

from ..errors import UnsafeCheckpointError
from ..format import weights_only_load

_ALLOW_LIST_LOCK = threading.Lock()

try:  # numpy >= 2.0 (and the 1.26 alias)
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

_NUMERIC_DTYPE_CODES = "?bBhHiIlLqQefdFD"


def _allow_list() -> list[Any]:
    dtype_classes = []
    for code in _NUMERIC_DTYPE_CODES:
        cls = type(np.dtype(code))
        if cls is not np.dtype and cls not in dtype_classes:
            dtype_classes.append(cls)
    return [
        (_np_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_np_reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        *dtype_classes,
    ]


ALLOWED_GLOBALS: tuple[Any, ...] = tuple(_allow_list())
"""The allow-list added to torch's defaults for every load (see the module docstring)."""


def _global_name(entry: Any) -> str:
    if isinstance(entry, tuple):
        return entry[1]
    return f"{entry.__module__}.{entry.__qualname__}"


ALLOWED_GLOBAL_NAMES: frozenset[str] = frozenset(_global_name(entry) for entry in ALLOWED_GLOBALS)
"""Pickle names (``module.qualname``) of :data:`ALLOWED_GLOBALS`."""


def _as_file(data: bytes | bytearray | memoryview | BinaryIO) -> BinaryIO:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(data))
    return data


def find_unsafe_globals(data: bytes | bytearray | memoryview | BinaryIO) -> list[str]:
    """Pickle globals in a ``torch.save`` payload that :func:`load_payload` would refuse (a static
    scan: nothing is imported or called).

    Args:
        data (bytes | BinaryIO): the payload (a ``torch.save`` zip archive).

    Returns:
        list[str]: sorted ``module.name`` strings outside torch's defaults and
        :data:`ALLOWED_GLOBAL_NAMES`; empty when weights-only loading can take the payload.

    Raises:
        ValueError: not a ``torch.save`` archive (or a pickle the scanner cannot parse).
    """
    handle = _as_file(data)
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(handle)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        raise ValueError(f"not a readable torch.save payload: {exc}") from exc
    return sorted(name for name in found if name not in ALLOWED_GLOBAL_NAMES)


def _weights_only_load(data: bytes | bytearray | memoryview | BinaryIO) -> Any:
    with _ALLOW_LIST_LOCK:
        present = set(torch.serialization.get_safe_globals())
        missing = [entry for entry in ALLOWED_GLOBALS if entry not in present]
        with torch.serialization.safe_globals(missing):
            return weights_only_load(_as_file(data), map_location="cpu")


def load_payload(
    data: bytes | bytearray | memoryview | BinaryIO, *, source: str, allow_pickle: bool = False
) -> Any:
    """Load one ``torch.save`` payload onto the CPU without running code (unless allowed).

    Args:
        data (bytes | BinaryIO): the payload bytes (already verified) or a seekable binary file.
        source (str): URL and payload name, for error messages.
        allow_pickle (bool): load a payload weights-only loading refuses with ``weights_only=False``,
            which runs the code the pickle names; trusted local files only.

    Returns:
        Any: the loaded object.

    Raises:
        UnsafeCheckpointError: refused and ``allow_pickle`` is False; names the globals and the opt-in.
    """
    try:
        return _weights_only_load(data)
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            handle = _as_file(data)
            handle.seek(0)
            return torch.load(handle, map_location="cpu", weights_only=False)
        try:
            handle = _as_file(data)
            handle.seek(0)
            names = find_unsafe_globals(handle)
        except ValueError:
            names = []
        detail = f" (it names {', '.join(names)})" if names else ""
        raise UnsafeCheckpointError(
            f"{source}: refused to load: weights-only loading cannot restore this payload{detail}. "
            "Loading it would run code named by the file. If it is an old pickle-only payload from "
            "a trusted local directory, pass allow_pickle=True; checkpoints on a bucket are never "
            f"loaded that way. ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from exc


# -- save-time sanitiser ---------------------------------------------------------------------

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_ATOMS = (torch.dtype, torch.device, torch.Size)


def _path_key(key: Any) -> str:
    return f"[{key!r}]"


def conversion_hint(value: Any) -> str:
    """How to turn a config-like or framework object (dataclass, pydantic, OmegaConf, dict subclass,
    enum, path, namedtuple, ``torch.Generator``, tensor subclass) into plain values; else empty.
    """
    import dataclasses
    import enum
    import pathlib

    kind = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "convert it with dataclasses.asdict(value) (and rebuild the dataclass after loading)"
    if callable(getattr(value, "model_dump", None)):
        return "convert it with value.model_dump() (pydantic; rebuild with Model.model_validate after loading)"
    if isinstance(value, enum.Enum):
        return "store value.value (or value.name) and rebuild the enum after loading"
    if isinstance(value, pathlib.PurePath):
        return "store str(path) and rebuild the path after loading"
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return "convert the namedtuple with value._asdict() or tuple(value)"
    if isinstance(value, torch.Generator):
        return "store generator.get_state() (a uint8 tensor) and set_state it after loading"
    if isinstance(value, torch.Tensor):
        return "store a plain tensor: value.as_subclass(torch.Tensor) or value.detach().clone()"
    if isinstance(value, collections.abc.Mapping):
        return ("convert it to a plain dict (OmegaConf: OmegaConf.to_container(cfg, resolve=True); "
                "a dict subclass or defaultdict: dict(value))")
    if isinstance(value, (collections.abc.Sequence, collections.abc.Set)) and not isinstance(value, (str, bytes)):
        return "convert it to a plain list, tuple or set (OmegaConf ListConfig: OmegaConf.to_container)"
    return ""


def _refuse(path: str, value: Any, why: str = "") -> UnsafeCheckpointError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    hint = conversion_hint(value)
    return UnsafeCheckpointError(
        f"{path} holds a {kind}, which torch.load(weights_only=True) cannot restore"
        f"{': ' + why if why else ''}; {hint + '. Otherwise ' if hint else ''}store plain Python values "
        "(None, bool, int, float, str, bytes, lists, tuples, dicts) or tensors instead"
    )


def _numpy_scalar(value: np.generic, path: str) -> Any:
    if isinstance(value, (np.bool_, np.integer, np.floating, np.complexfloating, np.str_, np.bytes_)):
        return value.item()
    raise _refuse(path, value, f"numpy scalar of dtype {value.dtype} has no plain equivalent")


def _numpy_array(value: np.ndarray, path: str) -> torch.Tensor:
    if value.dtype.kind not in "biufc":
        raise _refuse(path, value, f"ndarray of dtype {value.dtype} has no tensor equivalent")
    array = np.array(value, copy=True, order="C")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(array)
    except TypeError as exc:  # a numeric dtype torch does not support
        raise _refuse(path, value, f"ndarray of dtype {value.dtype}: {exc}") from exc


def sanitize_state(value: Any, *, path: str = "state") -> Any:
    """Return a copy of ``value`` that ``torch.load(weights_only=True)`` restores exactly.

    Kept: exact ``None``/``bool``/``int``/``float``/``complex``/``str``/``bytes``/``bytearray``,
    tensors and parameters, ``torch.dtype``/``device``/``Size``. Rebuilt (keys too): exact ``dict``,
    ``OrderedDict``, ``Counter``, ``list``, ``tuple``, ``set``. Converted: numpy scalars to the equal
    Python value, numeric ndarrays to tensors. Containers are copied, tensors are not.

    Args:
        value (Any): trainer or teacher state, an optimizer or scheduler ``state_dict()``, RNG state.
        path (str): the value's name in errors; key paths are appended (``trainer_state['a'][2]``).

    Returns:
        Any: the sanitised copy.

    Raises:
        UnsafeCheckpointError: any other type, or a reference cycle; names the key path and type.
    """
    return _sanitize(value, path, set())


def _sanitize(value: Any, path: str, active: set[int]) -> Any:
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value
    if kind in _TORCH_ATOMS:
        return value
    if isinstance(value, np.generic):
        return _numpy_scalar(value, path)
    if kind is np.ndarray:
        return _numpy_array(value, path)
    if kind in (dict, collections.OrderedDict, collections.Counter, list, tuple, set):
        ident = id(value)
        if ident in active:
            raise UnsafeCheckpointError(f"{path} contains a reference cycle; checkpoint state must be a tree")
        active.add(ident)
        try:
            if kind in (list, tuple, set):
                items = [_sanitize(item, f"{path}[{index}]", active) for index, item in enumerate(value)]
                return kind(items)
            out = kind()
            for key, item in value.items():
                clean_key = _sanitize(key, f"{path} key {key!r}", active)
                try:
                    hash(clean_key)
                except TypeError as exc:
                    raise _refuse(f"{path} key {key!r}", key, "a converted key is unhashable") from exc
                out[clean_key] = _sanitize(item, f"{path}{_path_key(key)}", active)
            return out
        finally:
            active.discard(ident)
    raise _refuse(path, value)


_YAML_SCALARS = (type(None), bool, int, float, str)


def plain_config_dict(value: Any, *, path: str = "config.as_dict()") -> Any:
    """Return ``value`` as plain YAML data for ``config.yaml``, or refuse it naming the key
    (``yaml.safe_dump`` would raise an untyped ``RepresenterError`` naming none).

    Kept: ``None``, ``bool``, ``int``, ``float``, ``str``; ``dict`` with ``str`` keys, ``list`` and
    ``tuple`` (as lists); numpy scalars are converted.

    Args:
        value (Any): ``config.as_dict()``.
        path (str): the value's name in errors.

    Returns:
        Any: data that ``yaml.safe_dump`` writes and ``yaml.safe_load`` reads back equal.

    Raises:
        UnsafeCheckpointError: any other value or a non-str key; names its path, type and conversion.
    """
    kind = type(value)
    if kind in _YAML_SCALARS:
        return value
    if isinstance(value, np.generic):
        converted = _numpy_scalar(value, path)
        if type(converted) in _YAML_SCALARS:
            return converted
        raise _refuse(path, value, "config.yaml holds None, bool, int, float and str scalars only")
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _refuse(f"{path} key {key!r}", key, "config.yaml keys must be str")
            out[key] = plain_config_dict(item, path=f"{path}{_path_key(key)}")
        return out
    if kind in (list, tuple):
        return [plain_config_dict(item, path=f"{path}[{index}]") for index, item in enumerate(value)]
    raise _refuse(path, value, "config.yaml holds plain YAML data only")


__all__ = [
    "ALLOWED_GLOBALS",
    "ALLOWED_GLOBAL_NAMES",
    "find_unsafe_globals",
    "conversion_hint",
    "load_payload",
    "plain_config_dict",
    "sanitize_state",
]
