"""What one store instance has seen complete: the manifests of steps it committed or verified.

A committed manifest never changes: it is created only if absent and never rewritten, and the
payloads it names lie under an attempt prefix no other save writes (docs/protocol.md). So a step
this process saw complete (its own commit, which listed every payload just before creating the
manifest, or a check that listed them) stays complete with the same manifest until it is deleted.
The after-save retention pass (:mod:`opd_store.retention._after_save`) reads each step's
manifest once per process through this record instead of once per save; a step that is gone from
the store's listing is forgotten, and :meth:`CheckpointStore.delete
<opd_store.store._checkpoint_store.CheckpointStore.delete>` forgets what it deletes.

What the record cannot see is damage done behind the process's back (a payload deleted by hand
after its step was seen complete); the full passes (``opd-store gc``, ``verify``, ``ls``) list
every step each time and find it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

from ..format import Manifest


@dataclasses.dataclass(frozen=True)
class KnownStep:
    """A step seen complete.

    Attributes:
        manifest (Manifest): its manifest.
        size_bytes (int): the bytes of its payloads.
    """

    manifest: Manifest
    size_bytes: int


class KnownSteps:
    """Steps one store instance saw complete (module docstring); safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[int, KnownStep] = {}

    def get(self, step: int) -> KnownStep | None:
        """What is known of ``step``, or ``None``."""
        with self._lock:
            return self._steps.get(step)

    def saw_complete(self, manifest: Manifest) -> None:
        """Record ``manifest``'s step as complete."""
        with self._lock:
            self._steps[manifest.step] = KnownStep(manifest, manifest.total_size_bytes)

    def forget(self, step: int) -> None:
        """Forget ``step`` (deleted, or found not complete)."""
        with self._lock:
            self._steps.pop(step, None)

    def keep_only(self, steps: Iterable[int]) -> None:
        """Forget every step not in ``steps`` (the store's listing: the others are gone)."""
        present = set(steps)
        with self._lock:
            for step in [s for s in self._steps if s not in present]:
                del self._steps[step]

    def __len__(self) -> int:
        with self._lock:
            return len(self._steps)


__all__ = ["KnownStep", "KnownSteps"]
