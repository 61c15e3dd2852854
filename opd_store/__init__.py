"""opd_store: crash-safe PyTorch checkpoints on any fsspec URL (write-then-commit-manifest).

A checkpoint exists exactly when its manifest object does; see docs/protocol.md. This module is the
public API; each layer's package (:mod:`opd_store.store`, :mod:`opd_store.retention`,
:mod:`opd_store.dcp`, :mod:`opd_store.opd`, ...) exports its own, and ARCHITECTURE.md maps them.
"""

from ._lazy import lazy_exports
from ._version import __version__
from .commit import PayloadWriter, Transaction
from .errors import (
    AmbiguousCommitError,
    CheckpointNotFoundError,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    OpdStoreError,
    PayloadUploadError,
    ResumeMismatchError,
    RetentionError,
    StoreNotFoundError,
    StoreRequestError,
    StoreUnreachableError,
    ThrottledUploadError,
    UnsafeCheckpointError,
    UnsupportedBackendError,
    UploadError,
)
from .format import Manifest, PayloadEntry
from .retention import RetentionPolicy
from .runtime import PreemptionWatcher
from .store import BaseStore, CheckpointInfo, CheckpointStore, Problem, VerifyReport
from .tiered import TieredStore

# The OPD layer needs torch: each name is imported on first use, so ``import opd_store`` and the
# store-only commands stay light.
_OPD_EXPORTS = ("AsyncCheckpointer", "GlobalSamplePosition", "OPDConfig", "SaveHandle", "latest_complete_checkpoint",
                "load_adapter", "load_opd_checkpoint", "load_sharded_opd_checkpoint", "migrate_legacy",
                "save_opd_checkpoint", "save_sharded_opd_checkpoint")
__getattr__ = lazy_exports(__name__, {name: "opd_store.opd" for name in _OPD_EXPORTS})

__all__ = sorted([
    *_OPD_EXPORTS,
    "AmbiguousCommitError",
    "BaseStore",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CommitConflictError",
    "CommitError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "OpdStoreError",
    "PayloadEntry",
    "PayloadUploadError",
    "PayloadWriter",
    "PreemptionWatcher",
    "Problem",
    "ResumeMismatchError",
    "RetentionError",
    "RetentionPolicy",
    "StoreNotFoundError",
    "StoreRequestError",
    "StoreUnreachableError",
    "ThrottledUploadError",
    "TieredStore",
    "Transaction",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "UploadError",
    "VerifyReport",
    "__version__",
])
