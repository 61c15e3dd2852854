"""``VerifiedCopy``: the payloads of one step read once, checked, and served again to every load of
a resume, so that verifying and loading share one download (docs/resume.md, "One download per
resume").

A resume reads a step twice without it: the resume guard reads every payload to find the newest
intact step (:mod:`opd_store.store._resume_guard`), then the loaders read the payloads they load
(``load_adapter``, ``load_opd_checkpoint``, and the two DCP loads of a sharded resume, which both
read the rank files). A ``VerifiedCopy`` is the store's read API in which the payloads of its step
are kept as they were read and checked:

* remote payloads (S3, GCS: one buffer per payload, :class:`~opd_store.storage.transfers.MemoryReader`)
  are kept in memory until :meth:`VerifiedCopy.release`, and every later ``open`` is a reader over
  that buffer (never lent to ``torch.load``: the loaded tensors are copies, so training that
  changes them in place never changes the bytes a later load reads);
* other readers (a local file, checksummed through a read-only map) are handed out once, and a
  second ``open`` reads the file again (a local read, no download).

Payloads are never rewritten after their commit (each attempt has its own prefix), so what was
checked stays what the store holds; the copy answers for its step as of its check. Every other
question (other steps, listings) goes to the wrapped store.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from ..storage.transfers import MemoryReader
from ._api import ReadableStore

if TYPE_CHECKING:
    from ..format import Manifest
    from ._status import CheckpointInfo, VerifyReport


class VerifiedCopy(ReadableStore):
    """The read API of ``store`` in which payloads of ``step`` are read once (module docstring).

    Args:
        store (ReadableStore): a plain, tiered or legacy-reading store.
        step (int): the step whose payloads are kept.
        keep (Callable[[str], bool] | None): which payloads to keep when :meth:`check` reads them
            (default: every one); a rank of a multi-rank resume keeps what it loads itself.

    Thread safety: ``open`` may be called from several threads.
    """

    def __init__(self, store: ReadableStore, step: int, *, keep: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.step = step
        self._keep = keep
        self._report: "VerifyReport | None" = None
        self._manifest: "Manifest | None" = None
        self._buffers: dict[str, Any] = {}
        self._readers: dict[str, BinaryIO] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VerifiedCopy({self.store!r}, step={self.step})"

    # -- the copy ------------------------------------------------------------------------------
    def check(self) -> "VerifyReport":
        """Verify the step deeply (every payload read once, its size and CRC32C checked), keeping
        the payloads ``keep`` selects; a damaged step keeps nothing.

        Returns:
            VerifyReport: the deep report (``ok`` when the step is intact).
        """
        self.release()
        report = self.store.verify(self.step, deep=True, keep=self._hold)
        if not report.ok:
            self.release()
            return report
        with self._lock:
            self._report = report
        return report

    def release(self) -> None:
        """Drop every kept payload (later reads go to the store)."""
        with self._lock:
            readers, self._readers, self._buffers = self._readers, {}, {}
            self._report = self._manifest = None
        for reader in readers.values():
            reader.close()

    def __enter__(self) -> "VerifiedCopy":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()

    def _hold(self, name: str, reader: BinaryIO) -> None:
        if self._keep is not None and not self._keep(name):
            reader.close()
            return
        lendable = getattr(reader, "lendable_buffer", None)
        buffer = lendable() if lendable is not None else None
        with self._lock:
            if buffer is not None:
                self._buffers[name] = buffer
                reader.close()
            else:
                self._readers[name] = reader

    # -- identity ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.store.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.store.storage_options

    def step_url(self, step: int) -> str:
        return self.store.step_url(step)

    def tiers(self) -> list:
        """The wrapped store's plain stores."""
        return self.store.tiers()

    def check_reachable(self, *, write: bool = True, timeout_secs: float | None = None) -> None:
        self.store.check_reachable(write=write, timeout_secs=timeout_secs)

    # -- reads ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return self.store.steps()

    def checkpoints(self) -> list["CheckpointInfo"]:
        return self.store.checkpoints()

    def is_complete(self, step: int) -> bool:
        return self.store.is_complete(step)

    def status(self, step: int) -> str:
        return self.store.status(step)

    def latest_step(self) -> int:
        return self.store.latest_step()

    def manifest(self, step: int) -> "Manifest":
        """The manifest of ``step`` (of the copy's step: read once)."""
        if step != self.step:
            return self.store.manifest(step)
        with self._lock:
            manifest = self._manifest
        if manifest is None:
            manifest = self.store.manifest(step)
            with self._lock:
                self._manifest = manifest
        return manifest

    def names(self, step: int) -> list[str]:
        return self.store.names(step)

    def read(self, step: int, name: str, *, manifest: "Manifest | None" = None) -> bytes:
        """Verified bytes of a payload (see :meth:`open`)."""
        with self.open(step, name, manifest=manifest) as reader:
            return reader.read()

    def open(self, step: int, name: str, *, manifest: "Manifest | None" = None) -> BinaryIO:
        """A reader of the verified bytes of a payload: of the copy's step, from the kept copy when
        there is one, else read (and checked) by the store once and kept (module docstring).

        Raises:
            CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, ManifestError: as
                the store's ``open``.
        """
        if step != self.step:
            return self.store.open(step, name, manifest=manifest)
        with self._lock:
            buffer = self._buffers.get(name)
            reader = self._readers.pop(name, None) if buffer is None else None
        if buffer is not None:
            return MemoryReader(buffer)
        if reader is not None:
            return reader
        reader = self.store.open(step, name, manifest=manifest if manifest is not None else self.manifest(step))
        lendable = getattr(reader, "lendable_buffer", None)
        buffer = lendable() if lendable is not None else None
        if buffer is None:
            return reader
        with self._lock:
            self._buffers[name] = buffer
        reader.close()
        return MemoryReader(buffer)

    def verify(self, step: int, *, deep: bool = False, keep=None) -> "VerifyReport":
        """The store's report of ``step``; of the copy's step once checked, the report of
        :meth:`check` (no request: it covers sizes and CRC32Cs)."""
        with self._lock:
            report = self._report if step == self.step and keep is None else None
        return report if report is not None else self.store.verify(step, deep=deep, keep=keep)


__all__ = ["VerifiedCopy"]
