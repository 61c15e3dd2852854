"""opd_store: crash-safe PyTorch checkpoints on any fsspec URL (write-then-commit-manifest).

A checkpoint exists exactly when its manifest object does; see docs/protocol.md.
"""

from ._version import __version__
from .errors import (
    AmbiguousCommitError,
    CheckpointNotFoundError,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    OpdStoreError,
    ResumeMismatchError,
    RetentionError,
    PayloadUploadError,
    StoreNotFoundError,
    StoreUnreachableError,
    UnsafeCheckpointError,
    UnsupportedBackendError,
    UploadError,
)
from .manifest import Manifest, PayloadEntry
from .payload_writer import PayloadWriter
from .status import CheckpointInfo, Problem, VerifyReport
from .store import CheckpointStore
from .store_api import BaseStore
from .tiered import TieredStore
from .transaction import Transaction

# The OPD layer needs torch (and pydantic/yaml for its config); import it on first use so that
# ``import opd_store`` and store-only tools stay light.
_LAZY = {
    "save_opd_checkpoint": "opd_store.opd.save",
    "load_opd_checkpoint": "opd_store.opd.load",
    "load_adapter": "opd_store.opd.adapter",
    "latest_complete_checkpoint": "opd_store.opd.load",
    "OPDConfig": "opd_store.opd.config",
    "migrate_legacy": "opd_store.opd.legacy",
    "AsyncCheckpointer": "opd_store.opd.async_save",
    "SaveHandle": "opd_store.opd.async_save",
    "PreemptionWatcher": "opd_store.preemption",
    "save_sharded_opd_checkpoint": "opd_store.opd.sharded",
    "load_sharded_opd_checkpoint": "opd_store.opd.sharded_load",
    "GlobalSamplePosition": "opd_store.opd.data",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'opd_store' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "AsyncCheckpointer",
    "PreemptionWatcher",
    "SaveHandle",
    "OPDConfig",
    "latest_complete_checkpoint",
    "load_adapter",
    "load_opd_checkpoint",
    "migrate_legacy",
    "save_opd_checkpoint",
    "save_sharded_opd_checkpoint",
    "load_sharded_opd_checkpoint",
    "GlobalSamplePosition",
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
    "PayloadWriter",
    "Problem",
    "ResumeMismatchError",
    "RetentionError",
    "PayloadUploadError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "TieredStore",
    "Transaction",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "UploadError",
    "VerifyReport",
    "__version__",
]
