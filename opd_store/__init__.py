"""opd_store: crash-safe PyTorch checkpoints on any fsspec URL (write-then-commit-manifest).

A checkpoint exists exactly when its manifest object does; see docs/protocol.md.
"""

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
    UnsafeCheckpointError,
    UnsupportedBackendError,
)
from .manifest import Manifest, PayloadEntry
from .store import CheckpointInfo, CheckpointStore, Problem, VerifyReport
from .transaction import PayloadWriter, Transaction

__version__ = "0.1.0"

__all__ = [
    "AmbiguousCommitError",
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
    "Transaction",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "VerifyReport",
    "__version__",
]
