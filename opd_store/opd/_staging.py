"""Staging buffers: the asynchronous save's private copy of every tensor, in reusable host memory."""

from __future__ import annotations

import collections
from typing import Any

import torch


class StagingBuffers:
    """Copies of a state's tensors in reusable host buffers (the snapshot's copy).

    The n-th tensor staged since :meth:`begin` reuses the previous snapshot's n-th buffer when dtype
    and shape match, so a steady-state save allocates nothing; reuse only once the previous write
    finished.

    Args:
        pin_memory (bool | None): pinned host memory for CUDA tensors (``None``: when CUDA is available).
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._buffers: list[torch.Tensor] = []
        self._cursor = 0
        self._cuda_sources = False
        self.staged_bytes = 0

    def begin(self) -> None:
        """Start a new snapshot (rewind to the first buffer)."""
        self._cursor = 0
        self._cuda_sources = False
        self.staged_bytes = 0

    def finish(self) -> None:
        """Wait for the device-to-host copies of this snapshot (no-op without CUDA sources)."""
        if self._cuda_sources:
            torch.cuda.synchronize()
        del self._buffers[self._cursor:]

    def stage(self, value: Any) -> Any:
        """An equal tree with every tensor copied into a staging buffer (containers rebuilt)."""
        kind = type(value)
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value)
        if kind in (dict, collections.OrderedDict, collections.Counter):
            copy = kind()
            for key, item in value.items():
                copy[key] = self.stage(item)
            return copy
        if kind is list:
            return [self.stage(item) for item in value]
        if kind is tuple:
            return tuple(self.stage(item) for item in value)
        if kind is set:
            return {self.stage(item) for item in value}
        return value

    def _buffer(self, source: torch.Tensor) -> torch.Tensor:
        index = self._cursor
        self._cursor += 1
        pinned = self.pin_memory and source.is_cuda
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.dtype == source.dtype and buffer.shape == source.shape and buffer.is_pinned() == pinned:
                return buffer
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    def _stage_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if source.layout != torch.strided or source.device.type not in ("cpu", "cuda"):
            copy = source.to("cpu", copy=True)  # sparse or exotic: a plain private copy
        else:
            copy = self._buffer(source)
            copy.copy_(source, non_blocking=source.is_cuda)
            self._cuda_sources = self._cuda_sources or source.is_cuda
        self.staged_bytes += copy.numel() * copy.element_size()
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
        return copy


__all__ = ["StagingBuffers"]
