"""Error types of opd_store.

Every error raised on purpose by opd_store derives from :class:`OpdStoreError` and also from the
builtin that matches its meaning, so code written against the seed implementation (which raised
plain ``FileNotFoundError``, ``FileExistsError`` and ``ValueError``) and code written against fsspec
(which maps backend errors to the same builtins) keeps catching them. The backend's own exception,
when there is one, is kept as ``__cause__``.
"""

from __future__ import annotations


class OpdStoreError(Exception):
    """Root of every error that opd_store raises on purpose."""


class CheckpointNotFoundError(OpdStoreError, FileNotFoundError):
    """No checkpoint (or no complete checkpoint, or no such payload) where one was asked for."""


class CommitConflictError(OpdStoreError, FileExistsError):
    """The step is already committed (or holds a legacy checkpoint), or another attempt won."""


class IntegrityError(OpdStoreError, ValueError):
    """A payload's bytes differ from what its manifest records (size or CRC32C)."""


class ManifestError(OpdStoreError, ValueError):
    """A manifest object exists but cannot be parsed or is inconsistent with its location."""


class IncompleteCheckpointError(OpdStoreError, ValueError):
    """A checkpoint is not complete: no manifest, or an object it lists is missing or short."""


class UnsupportedBackendError(OpdStoreError, ValueError):
    """The fsspec backend has no create-only write and the caller did not opt in to check-then-put."""


class CommitError(OpdStoreError, OSError):
    """The manifest create failed and reading it back found no manifest: the step is not
    committed. The attempt's payloads are kept (a delayed create could still land) for gc."""


class AmbiguousCommitError(CommitError):
    """The manifest create failed in a way that may or may not have landed, and reading it back
    failed too, so the outcome is unknown. Payloads are kept; ask ``is_complete`` later."""


class StoreUnreachableError(OpdStoreError, OSError):
    """The store cannot be used at all: no such bucket, no credentials, no connection."""


class UploadError(OpdStoreError, OSError):
    """A tiered store's background upload of a locally committed step to the bucket failed
    (issue 8, item 3). The step stays committed in the local tier and is not durable; the
    backend's or the copy's error is the ``__cause__``."""


class ResumeMismatchError(OpdStoreError, ValueError):
    """A checkpoint cannot be resumed under the current config, provenance or world size."""


class UnsafeCheckpointError(OpdStoreError, ValueError):
    """Checkpoint state that weights-only loading could not restore, refused at save or load."""


__all__ = [
    "AmbiguousCommitError",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "CommitError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "ManifestError",
    "OpdStoreError",
    "ResumeMismatchError",
    "StoreUnreachableError",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "UploadError",
]
