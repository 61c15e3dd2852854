"""Per-rank RNG state: capture, restore, and protection of the global generators around a save.

An OPD update draws from Python's ``random``, numpy's legacy global generator, torch's CPU
generator and each CUDA device's; exact resume needs all of them back (the seed; field notes:
"rank 1 restored with rank 0's RNG"), and a save must move none (botocore's retry back-off draws
from ``random``). Format ``opd_rng_v1`` loads weights-only with no allow-list::

    {"format": "opd_rng_v1",
     "python": random.getstate(),
     "numpy": {"bit_generator": "MT19937", "key": int64 tensor [624] (uint32 values widened),
               "pos": int, "has_gauss": int, "cached_gaussian": float},
     "torch": uint8 tensor [5056],
     "cuda": [uint8 tensor per device]}   # only when CUDA is available

:func:`restore_rng_state` also takes the seed's format (numpy's ``get_state()`` tuple).
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
    """Capture the calling process's global RNG states (``opd_rng_v1``).

    Rank obligations: every rank calls this for itself; in single-writer mode rank 0 passes every
    rank's result, in rank order, as ``save_opd_checkpoint(rank_rng_states=...)``.
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
    """A fresh ``opd_rng_v1`` state seeded from ``seed`` alone, the same on every machine: where the
    new ranks of an elastic resume start.

    Args:
        seed (int): ``0 <= seed < 2**63``; numpy takes ``seed % 2**32``, CUDA device ``d`` ``seed + d``.

    Raises:
        ValueError: ``seed`` out of range.
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
    """Set this process's global RNGs from ``opd_rng_v1`` or the seed's format; absent keys are left.

    A different CUDA device count restores the common prefix with a ``RuntimeWarning``; without CUDA
    the saved CUDA states are skipped with a warning.

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
    """Snapshot every global RNG on entry and restore it on exit, even when the body raises.

    Wraps every OPD save: botocore's retry back-off draws from ``random``, and ``save_pretrained`` or
    fsspec may draw from numpy or torch. CUDA is snapshotted only when already initialised (else
    nothing drew from it, and snapshotting would create a context). Not thread-safe: other threads'
    draws during the body are undone.
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
