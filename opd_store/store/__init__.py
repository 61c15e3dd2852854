"""Checkpoints under one URL: the store API in three parts (:class:`ReadableStore`,
:class:`WritableStore`, :class:`Durability`; together :class:`BaseStore`), the plain store
(:class:`CheckpointStore`), what a step is (:mod:`._status`: complete, incomplete, corrupt,
uncommitted), verified reads, pins, the one copy routine (:func:`copy_files`), the legacy adapter
(:mod:`._legacy`: the predecessor's layout, read and imported), the rules every resume shares
for damaged steps (:mod:`._resume_guard`) and the one download a resume makes (:class:`VerifiedCopy`)."""

from ._api import BaseStore, DurableHook, Durability, ReadableStore, RetentionTier, WritableStore
from ._checkpoint_store import CheckpointStore
from ._copy import FileCheck, Progress, SourceFile, copy_checkpoint, copy_files
from ._legacy import (
    LEGACY,
    Importer,
    LegacyReader,
    MigrationResult,
    StepImport,
    holds_legacy_marker,
    import_legacy_steps,
)
from ._pins import pin, pinned_steps, unpin
from ._refs import as_store, split_checkpoint_url
from ._resume_guard import ResumePoint, find_resume_point, newest_intact_step, refuse_damaged_step_ahead, remedy
from ._status import COMPLETE, CORRUPT, INCOMPLETE, UNCOMMITTED, CheckpointInfo, Problem, VerifyReport
from ._verified_copy import VerifiedCopy

__all__ = [
    "COMPLETE", "CORRUPT", "INCOMPLETE", "LEGACY", "UNCOMMITTED", "BaseStore", "CheckpointInfo", "CheckpointStore",
    "DurableHook", "Durability", "FileCheck", "Importer", "LegacyReader", "MigrationResult", "Problem", "Progress",
    "ReadableStore", "ResumePoint", "RetentionTier", "SourceFile", "StepImport", "VerifiedCopy", "VerifyReport",
    "WritableStore", "as_store", "copy_checkpoint", "copy_files", "find_resume_point", "holds_legacy_marker",
    "import_legacy_steps", "newest_intact_step", "pin", "pinned_steps", "refuse_damaged_step_ahead", "remedy",
    "split_checkpoint_url", "unpin",
]
