"""Checkpoints under one URL: the store API (:class:`BaseStore`), the plain store
(:class:`CheckpointStore`), what a step is (:mod:`._status`: complete, incomplete, corrupt,
legacy, uncommitted), verified reads, pins, copies between stores, and the rules every resume
shares for damaged steps (:mod:`._resume_guard`)."""

from ._api import BaseStore, DurableHook, RetentionTier
from ._checkpoint_store import CheckpointStore
from ._copy import Progress, copy_checkpoint, stream_payload
from ._pins import pin, pinned_steps, unpin
from ._refs import as_store, split_checkpoint_url
from ._resume_guard import newest_intact_step, refuse_damaged_step_ahead
from ._status import COMPLETE, CORRUPT, INCOMPLETE, LEGACY, UNCOMMITTED, CheckpointInfo, Problem, VerifyReport

__all__ = [
    "COMPLETE", "CORRUPT", "INCOMPLETE", "LEGACY", "UNCOMMITTED", "BaseStore", "CheckpointInfo", "CheckpointStore",
    "DurableHook", "Problem", "Progress", "RetentionTier", "VerifyReport", "as_store", "copy_checkpoint",
    "newest_intact_step", "pin", "pinned_steps", "refuse_damaged_step_ahead", "split_checkpoint_url",
    "stream_payload", "unpin",
]
