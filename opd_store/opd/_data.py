"""Resuming a shuffled ``torch.utils.data.DataLoader`` mid-epoch (docs/resume.md, "Data order").

A shuffled loader's epoch is decided by its ``generator``'s state when the epoch's iterator is
created, so the position is three values: that state, the epoch, and the batches handed out.
:class:`LoaderPosition` keeps them for one run; :class:`GlobalSamplePosition` keeps a global
sample index that an elastic resume re-splits over another number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._rng import preserve_global_rng

STATE_KEYS = ("epoch", "batches_done", "epoch_start_generator_state")


def _checked_position(state: Mapping[str, Any], keys: tuple[str, ...], what: str,
                      generator: torch.Generator) -> tuple[int, int, torch.Tensor]:
    """``(epoch, counter, epoch-start generator state)`` of a saved position whose ``keys`` are
    ``(epoch, <counter>, epoch_start_generator_state)``; ``what`` names it in errors.

    Raises:
        ValueError: a key is missing, a counter is not a non-negative int, or the generator state
            is not a ``torch.uint8`` tensor of ``generator``'s state size.
    """
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{what} is missing {missing}")
    epoch_key, counter_key, start_key = keys
    epoch, counter, start = state[epoch_key], state[counter_key], state[start_key]
    for name, value in ((epoch_key, epoch), (counter_key, counter)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{what} {name} must be a non-negative int, got {value!r}")
    current = generator.get_state()
    if not isinstance(start, torch.Tensor) or start.dtype != torch.uint8 or start.shape != current.shape:
        raise ValueError(f"{what} {start_key} must be a torch.uint8 tensor of shape {tuple(current.shape)} "
                         f"(this generator's state), got {start!r:.80}")
    return epoch, counter, start


class LoaderPosition:
    """Where a run is in the data order of a shuffled ``DataLoader``, saveable in trainer state.

    Args:
        generator (torch.Generator): the CPU generator passed to ``DataLoader(..., generator=)``.

    Attributes:
        epoch (int): the epoch in progress (0 before the first).
        batches_done (int): batches of ``epoch`` handed out so far.

    Raises:
        TypeError: ``generator`` is not a ``torch.Generator``.
    """

    def __init__(self, generator: torch.Generator) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"LoaderPosition needs the loader's torch.Generator, got {type(generator).__name__}")
        self.generator = generator
        self.epoch = 0
        self.batches_done = 0
        self._epoch_start_state: torch.Tensor | None = None
        self._resume_pending = False

    def state_dict(self) -> dict[str, Any]:
        """The position as plain values for ``trainer_state``.

        Returns:
            dict: ``epoch`` (int), ``batches_done`` (int) and ``epoch_start_generator_state``
            (``torch.uint8`` tensor, the generator's state before the epoch's iterator was made;
            the current state when no epoch has started).
        """
        start = self._epoch_start_state if self._epoch_start_state is not None else self.generator.get_state()
        return {
            "epoch": int(self.epoch),
            "batches_done": int(self.batches_done),
            "epoch_start_generator_state": start.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved position; the next :meth:`iterate` of ``state["epoch"]`` continues it.

        Args:
            state (Mapping): from :meth:`state_dict` (after a checkpoint round trip).

        Raises:
            ValueError: a key is missing, a counter is not a non-negative int, or the generator
                state is not a ``torch.uint8`` tensor of this generator's state size.
        """
        self.epoch, self.batches_done, start = _checked_position(state, STATE_KEYS, "loader position", self.generator)
        self._epoch_start_state = start.clone()
        self._resume_pending = True

    def iterate(self, loader: Any, epoch: int) -> Iterator[Any]:
        """Yield ``loader``'s batches of ``epoch``, continuing a loaded position.

        A loaded epoch restarts the generator at the epoch's start and skips the batches already handed
        out, fetching them with every global RNG snapshotted and restored (dataset code that draws must
        not move the restored streams). A batch counts once handed out: save after training on it.

        Args:
            loader (torch.utils.data.DataLoader): built with ``generator=`` this position's generator,
                without ``persistent_workers`` (their RNG state is in no checkpoint).
            epoch (int): the epoch to iterate, ``>= self.epoch``.

        Yields:
            Any: the loader's batches.

        Raises:
            ValueError: the loader has another (or no) generator, uses persistent workers, or ``epoch``
                is before the position's epoch.
        """
        if getattr(loader, "generator", None) is not self.generator:
            raise ValueError(
                "the DataLoader must be built with generator= this LoaderPosition's generator: a loader "
                "without one shuffles from the global torch RNG, which a mid-epoch checkpoint cannot replay"
            )
        if getattr(loader, "persistent_workers", False):
            raise ValueError("LoaderPosition does not support persistent_workers=True (worker RNG state is not saved)")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < self.epoch:
            raise ValueError(f"epoch {epoch!r} is before the loader position's epoch {self.epoch}")
        skip = 0
        if self._resume_pending and epoch == self.epoch:
            assert self._epoch_start_state is not None
            self.generator.set_state(self._epoch_start_state)
            skip = self.batches_done
        else:
            self.epoch = epoch
            self._epoch_start_state = self.generator.get_state()
            self.batches_done = 0
        self._resume_pending = False
        iterator = iter(loader)
        if skip:
            with preserve_global_rng():
                for _ in range(skip):
                    if next(iterator, _END) is _END:
                        return
        for batch in iterator:
            self.batches_done += 1
            yield batch


_END = object()

GLOBAL_STATE_KEYS = ("epoch", "samples_done", "epoch_start_generator_state")


class GlobalSamplePosition:
    """Where a multi-rank run is in its data order, as a global sample index (elastic-safe).

    Each epoch's order is a permutation drawn from ``generator``; rank ``r`` takes ``batch_size``
    samples from ``samples_done + r * batch_size``, and ``samples_done`` (replicated) advances by
    ``world_size * batch_size``. The last step of an epoch hands out what remains, so every rank
    takes the same number of steps (docs/resume.md, "The data position as a global sample index").

    Args:
        generator (torch.Generator): a CPU generator seeded the same on every rank.
        dataset_size (int), batch_size (int): samples in the dataset / per rank per step, ``> 0``.
        rank (int), world_size (int): this rank, ``0 <= rank < world_size``.

    Attributes:
        epoch (int): the epoch in progress.
        samples_done (int): samples of the epoch's order handed out to all ranks together.

    Raises:
        TypeError: ``generator`` is not a ``torch.Generator``.
        ValueError: a size is < 1 or ``rank`` is out of range.
    """

    def __init__(self, generator: torch.Generator, *, dataset_size: int, batch_size: int, rank: int,
                 world_size: int) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"GlobalSamplePosition needs a torch.Generator, got {type(generator).__name__}")
        if dataset_size < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need dataset_size, batch_size, world_size >= 1 and 0 <= rank < world_size, got "
                             f"{dataset_size}, {batch_size}, {world_size}, rank {rank}")
        self.generator = generator
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.samples_done = 0
        self._epoch_start_state: torch.Tensor | None = None
        self._resume_pending = False

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` (int), ``samples_done`` (int, global) and ``epoch_start_generator_state``
        (``torch.uint8`` tensor); the same on every rank."""
        start = self._epoch_start_state if self._epoch_start_state is not None else self.generator.get_state()
        return {"epoch": int(self.epoch), "samples_done": int(self.samples_done),
                "epoch_start_generator_state": start.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved position (saved at any world size); the next :meth:`iterate` continues it.

        Raises:
            ValueError: a key is missing, a counter is not a non-negative int, or the generator
                state is not a ``torch.uint8`` tensor of this generator's state size.
        """
        self.epoch, self.samples_done, start = _checked_position(state, GLOBAL_STATE_KEYS, "sample position",
                                                                 self.generator)
        self._epoch_start_state = start.clone()
        self._resume_pending = True

    def iterate(self, epoch: int) -> Iterator[list[int]]:
        """Yield this rank's sample indices of ``epoch``, one list per step, continuing a loaded
        position. A step counts as handed out when it is yielded: save after training on it.

        Raises:
            ValueError: ``epoch`` is before the position's epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < self.epoch:
            raise ValueError(f"epoch {epoch!r} is before the sample position's epoch {self.epoch}")
        if self._resume_pending and epoch == self.epoch:
            assert self._epoch_start_state is not None
            self.generator.set_state(self._epoch_start_state)
        else:
            self.epoch, self.samples_done = epoch, 0
            self._epoch_start_state = self.generator.get_state()
        self._resume_pending = False
        order = torch.randperm(self.dataset_size, generator=self.generator).tolist()
        step = self.world_size * self.batch_size
        while self.samples_done < self.dataset_size:
            start = self.samples_done + self.rank * self.batch_size
            self.samples_done = min(self.samples_done + step, self.dataset_size)
            yield order[start:min(start + self.batch_size, self.samples_done)]


__all__ = ["GlobalSamplePosition", "LoaderPosition"]
