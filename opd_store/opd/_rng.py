"""Per-rank RNG state: capture, restore, and protection of the global generators around a save.

An OPD update draws from four global generators: Python's :mod:`random`, numpy's legacy global
generator (``np.random.*``, a ``RandomState``), torch's CPU generator and, where CUDA is available,
one generator per CUDA device. Exact resume needs all of them back (the seed's contract; field
notes: "rank 1 restored with rank 0's RNG"), and a save must not move any of them: botocore's retry
back-off draws from Python's ``random``, so an S3 retry during a save would shift the training's
random stream.

State format (``opd_rng_v1``), chosen so that ``torch.load(weights_only=True)`` restores it with no
allow-list at all (a checkpoint from a bucket never runs code on load)::

    {
        "format": "opd_rng_v1",
        "python": (int, tuple[int, ...], float | None),    # random.getstate(), unchanged
        "numpy": {
            "bit_generator": "MT19937",
            "key": torch.Tensor,     # int64, shape [624]: the MT19937 key, uint32 values widened
            "pos": int,
            "has_gauss": int,
            "cached_gaussian": float,
        },
        "torch": torch.Tensor,       # uint8, shape [5056]: torch.get_rng_state()
        "cuda": list[torch.Tensor],  # uint8, one per CUDA device, only when CUDA is available
    }

numpy's own ``get_state()`` tuple holds a ``uint32`` ndarray, which weights-only loading can only
take through numpy's array reconstructor; widening the key to an ``int64`` tensor keeps every bit
(each value is below 2**32) and removes the numpy pickle from the file. :func:`restore_rng_state`
also takes the seed's format (numpy's ``get_state()`` tuple under ``"numpy"``), so legacy
``rng.pt`` files restore with the same call.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

RNG_FORMAT = "opd_rng_v1"


def _numpy_state() -> dict[str, Any]:
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _restore_numpy(state: Any) -> None:
    if isinstance(state, Mapping) and "key" in state:
        key = state["key"]
        key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        np.random.set_state(
            (
                str(state["bit_generator"]),
                key.astype(np.uint32),
                int(state["pos"]),
                int(state["has_gauss"]),
                float(state["cached_gaussian"]),
            )
        )
    else:
        # The seed's format: numpy's own get_state() tuple (or its legacy=False dict).
        np.random.set_state(state)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def capture_rng_state() -> dict[str, Any]:
    """Capture the calling process's global RNG states (this rank's).

    Rank obligations: every rank calls this for itself (the state is per process); in
    single-writer mode rank 0 gathers the results in rank order and passes them to
    ``save_opd_checkpoint(rank_rng_states=...)``.

    Returns:
        dict: the ``opd_rng_v1`` state of the module docstring; ``torch`` is a uint8 tensor of
        shape ``[5056]``, ``numpy.key`` an int64 tensor of shape ``[624]``, ``cuda`` (present
        only when CUDA is available) one uint8 tensor per device. Loadable with
        ``torch.load(weights_only=True)`` without any allow-list.
    """
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if _cuda_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def derived_rng_state(seed: int) -> dict[str, Any]:
    """A fresh ``opd_rng_v1`` state of every global generator, seeded from ``seed`` alone.

    The same ``seed`` gives the same state on every machine and torch/numpy build of the same
    generator algorithms (Mersenne Twister for Python and numpy, torch's CPU Philox/MT): the
    state new ranks of an elastic resume start from (:mod:`opd_store.opd._elastic`).

    Args:
        seed (int): ``0 <= seed < 2**63``; numpy's legacy generator takes ``seed % 2**32``, and
            CUDA device ``d`` (when CUDA is available) is seeded with ``seed + d``.

    Returns:
        dict: as :func:`capture_rng_state` (``cuda`` only when CUDA is available).
    """
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    name, key, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": random.Random(seed).getstate(),
        "numpy": {"bit_generator": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.Generator().manual_seed(seed).get_state(),
    }
    if _cuda_available():
        state["cuda"] = [torch.Generator(device=f"cuda:{device}").manual_seed(seed + device).get_state()
                         for device in range(torch.cuda.device_count())]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the global RNGs of this process from a captured state.

    Accepts the ``opd_rng_v1`` format and the seed's format (``python``, ``numpy`` as numpy's
    ``get_state()`` tuple, ``torch``, optional ``cuda``). Keys that are absent are left alone.

    CUDA: a saved ``cuda`` list is restored device by device. When this process sees a different
    number of devices, the common prefix is restored and a ``RuntimeWarning`` names both counts;
    when CUDA is unavailable the saved CUDA states are skipped with a warning (inspection of a GPU
    checkpoint on a CPU machine). The world size itself is checked by the resume validation.

    Args:
        state (Mapping[str, Any]): from :func:`capture_rng_state` or a seed ``rng.pt``.

    Raises:
        ValueError: ``state`` is not a mapping, or names an unknown ``format``.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"RNG state must be a mapping, got {type(state).__name__}")
    fmt = state.get("format", RNG_FORMAT)
    if fmt != RNG_FORMAT:
        raise ValueError(f"unknown RNG state format {fmt!r} (expected {RNG_FORMAT!r})")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "numpy" in state:
        _restore_numpy(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    cuda_states = state.get("cuda")
    if cuda_states:
        if not _cuda_available():
            warnings.warn(
                f"RNG state holds {len(cuda_states)} CUDA generator state(s) but CUDA is not "
                "available here; they were not restored",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            warnings.warn(
                f"RNG state holds {len(cuda_states)} CUDA generator state(s) but this process sees "
                f"{count} device(s); restored the first {min(count, len(cuda_states))}",
                RuntimeWarning,
                stacklevel=2,
            )
        for device, cuda_state in enumerate(list(cuda_states)[:count]):
            torch.cuda.set_rng_state(torch.as_tensor(cuda_state, dtype=torch.uint8).cpu(), device)


@contextlib.contextmanager
def preserve_global_rng() -> Iterator[None]:
    """Snapshot every global RNG on entry and put it back on exit, even when the body raises.

    Wraps every synchronous OPD save: botocore's retry back-off draws from Python's
    ``random`` (``random.random()`` in both its legacy and standard retry modes), and third-party
    code run during a save (``save_pretrained``, fsspec) may draw from numpy or torch. CUDA
    generators are snapshotted when CUDA is already initialised in this process; when it is not,
    nothing in the body has drawn from them and snapshotting would create a CUDA context on every
    device for nothing.

    Not thread-safe against other threads drawing from the same global generators while the body
    runs: their draws are undone on exit.
    """
    snapshot: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if _cuda_available() and torch.cuda.is_initialized():
        snapshot["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        yield
    finally:
        random.setstate(snapshot["python"])
        np.random.set_state(snapshot["numpy"])
        torch.set_rng_state(snapshot["torch"])
        if "cuda" in snapshot:
            torch.cuda.set_rng_state_all(snapshot["cuda"])


__all__ = ["RNG_FORMAT", "capture_rng_state", "derived_rng_state", "preserve_global_rng", "restore_rng_state"]
