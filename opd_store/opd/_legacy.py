"""Migrating the seed's OPD checkpoints (legacy ``step-NNNNNN/`` directories) into any store.

The copy and its verification are :func:`opd_store.store.import_legacy_steps`'; this module adds
the OPD layer's rules: the step must hold ``training_state.pt`` (copied first; its counters,
fingerprints and world size become the manifest's), and a possible pickle (``.pt``, ``.bin``,
``.pth``, held whole to be scanned) must load weights-only, the only way a migrated checkpoint is
loaded. docs/resume.md, "Legacy checkpoints".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointNotFoundError, UnsafeCheckpointError
from ..store import CheckpointStore, MigrationResult, SourceFile, as_store, import_legacy_steps
from ._names import TRAINING_STATE
from ._safe_load import find_unsafe_globals, load_payload

_PICKLED_SUFFIXES = (".pt", ".bin", ".pth")
"""Files that may be ``torch.save`` archives: proven loadable weights-only."""


class _WholeFile:
    """A check that keeps a file's bytes as they stream, then runs ``finish(bytes)``."""

    def __init__(self, finish) -> None:
        self._data = bytearray()
        self._finish = finish

    def update(self, view: memoryview) -> None:
        self._data += view

    def finish(self) -> None:
        data, self._data = bytes(self._data), bytearray()
        self._finish(data)


class _OPDStepImport:
    """One legacy OPD step being imported (a :class:`~opd_store.store.StepImport`).

    Raises:
        CheckpointNotFoundError: (at construction) the step has no ``training_state.pt``.
    """

    def __init__(self, url: str, files: list[SourceFile]) -> None:
        if not any(file.name == TRAINING_STATE for file in files):
            raise CheckpointNotFoundError(f"legacy checkpoint {url} has no {TRAINING_STATE}")
        self.url = url
        # training_state.pt first: its checks refuse the step before anything large streams.
        self.files = sorted(files, key=lambda file: file.name != TRAINING_STATE)
        self.world_size = 1
        self.metadata: dict[str, Any] = {"migrated_from": url, "source_layout": "legacy"}

    def check(self, file: SourceFile):
        if not file.name.endswith(_PICKLED_SUFFIXES):
            return None
        return _WholeFile(lambda data: self._check_pickle(file.name, data))

    def manifest_fields(self) -> tuple[int, dict[str, Any]]:
        return self.world_size, self.metadata

    def _check_pickle(self, name: str, data: bytes) -> None:
        """A possible pickle loads weights-only; ``training_state.pt`` also gives the manifest fields.

        Raises:
            UnsafeCheckpointError: the file needs plain pickle to load.
        """
        try:
            unsafe = find_unsafe_globals(data)
        except ValueError:
            unsafe = None  # not a torch.save archive: copied as bytes, like any other file
        if unsafe:
            raise UnsafeCheckpointError(
                f"{self.url}/{name} needs plain pickle to load (it names {', '.join(unsafe)}); a migrated "
                "checkpoint is only ever loaded weights-only, so it would be unloadable. Load it from "
                "its local directory with allow_pickle=True and save it again with save_opd_checkpoint"
            )
        if name == TRAINING_STATE:
            self._record(load_payload(data, source=f"{self.url}/{TRAINING_STATE}"))

    def _record(self, payload: Any) -> None:
        """The trainer counters, fingerprints and world size of the training state, as metadata."""
        if not isinstance(payload, dict):
            self.metadata["world_size"] = self.world_size
            return
        trainer = payload.get("trainer") if isinstance(payload.get("trainer"), dict) else {}
        for key in ("attempted_updates", "successful_updates", "query_update"):
            value = trainer.get(key)
            if value is None or isinstance(value, (bool, int, float, str)):
                self.metadata[key] = value
        self.metadata["opd_schema"] = payload.get("schema")
        fingerprint = payload.get("config_fingerprint")
        self.metadata["config_fingerprint"] = fingerprint if isinstance(fingerprint, str) else None
        provenance = payload.get("provenance_fingerprints")
        if isinstance(provenance, dict) and all(isinstance(v, str) for v in provenance.values()):
            self.metadata["provenance_fingerprints"] = {str(k): v for k, v in provenance.items()}
        saved = payload.get("world_size")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
            self.world_size = saved
        self.metadata["world_size"] = self.world_size


def migrate_legacy(
    src_dir: str | os.PathLike | CheckpointStore,
    dst: str | os.PathLike | CheckpointStore,
    *,
    storage_options: dict[str, Any] | None = None,
    steps: Iterable[int] | None = None,
) -> MigrationResult:
    """Copy the seed's checkpoints into a store as manifest-committed, verified checkpoints.

    Steps are copied in ascending order, one commit each; a failure leaves the earlier steps
    committed (a rerun skips them as identical).

    Args:
        src_dir (str | os.PathLike | CheckpointStore): the seed's checkpoints directory.
        dst (str | os.PathLike | CheckpointStore): destination: local path, fsspec URL or store.
        storage_options (dict | None): fsspec options for ``dst`` when it is a URL.
        steps (Iterable[int] | None): only these steps; default every legacy step with ``COMPLETE``.

    Returns:
        MigrationResult: a ``list[str]`` of the new checkpoints' URLs in step order; ``skipped``
        lists steps already at the destination with identical content.

    Rank obligations: one process runs it (not part of training).

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) a requested step is not a legacy step of
            ``src_dir``, or one lacks ``training_state.pt``.
        CommitConflictError: (a ``FileExistsError``) the destination step holds different, incomplete
            or corrupt content, naming the differing files; nothing is overwritten.
        UnsafeCheckpointError: (a ``ValueError``) a source ``.pt`` payload needs plain pickle; nothing
            of that step is committed.
        IntegrityError: (a ``ValueError``) a source file changed while copied (nothing committed), or
            the read-back differs from the source (that copy is deleted).
        IncompleteCheckpointError: (a ``ValueError``) a source file vanished while it was copied.
    """
    return import_legacy_steps(as_store(src_dir), as_store(dst, storage_options), _OPDStepImport, steps=steps)


__all__ = ["MigrationResult", "migrate_legacy"]
