"""Error types of opd_store.

Every error raised on purpose derives from :class:`OpdStoreError` and from the builtin matching
its meaning, so code written against the seed (plain ``FileNotFoundError``, ``FileExistsError``,
``ValueError``) or fsspec (the same builtins) keeps catching them; a backend's own exception is
the ``__cause__``.
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


class StoragePermissionError(OpdStoreError, PermissionError):
    """The backend refused a request for lack of permission. Names the refused operation
    (``CreateMultipartUpload``, ``UploadPart``, ``PutObject`` on S3), the object URL and the step: a
    policy allowing ``PutObject`` but not multipart fails only for payloads above the block size.
    """


class RankFailedError(OpdStoreError, OSError):
    """A collective operation of a multi-rank job failed on one or more ranks; raised with the same
    message on every rank (a failing rank's own exception is the ``__cause__``).

    Attributes:
        failures (dict[int, str]): rank to ``"<ErrorType>: <message>"`` of each rank that failed.
    """

    failures: dict[int, str]

    @classmethod
    def from_failures(cls, message: str, failures: dict[int, str]) -> "RankFailedError":
        error = cls(message)  # one argument: OSError would read two as (errno, strerror)
        error.failures = dict(failures)
        return error


class DistributedSaveError(RankFailedError, CommitError):
    """A multi-rank save was not committed because a rank failed before the commit (or the
    committing rank's manifest create failed). Nothing was committed; previous steps are intact."""


class DistributedCommitConflictError(DistributedSaveError, CommitConflictError):
    """A multi-rank save refused because its step is already committed (also a ``FileExistsError``)."""


class DistributedAmbiguousCommitError(DistributedSaveError, AmbiguousCommitError):
    """A multi-rank save whose manifest create may or may not have landed, raised on every rank: ask
    ``is_complete`` later.
    """


class DistributedPermissionError(DistributedSaveError, StoragePermissionError):
    """A multi-rank save every failing rank of which the backend refused for lack of permission."""


class DistributedLoadError(RankFailedError):
    """A multi-rank load failed on some ranks; every rank raises it. A rank whose own load
    succeeded may already have restored its state: the job must not continue on it."""


class PayloadUploadError(OpdStoreError, OSError):
    """A payload's upload failed after the client's retries; its multipart upload was aborted and
    the step is not committed. Names the object (its URL holds the step and the payload) and the
    request that failed; the backend's error is the ``__cause__``."""


class ThrottledUploadError(PayloadUploadError):
    """A payload's request was refused for the store's request rate (S3 ``SlowDown``, GCS ``429``)
    for longer than the storage option ``throttle_timeout_secs`` from its first refusal: the
    upload is aborted and the step not committed, as for any failed part. Names the object, the
    request and how long it was throttled; the last refusal is the ``__cause__``."""


class StoreRequestError(OpdStoreError, OSError):
    """A read failed after the client's retries with neither a missing object nor a permission refusal
    (throttling: S3 ``SlowDown``, GCS 429; a server error); names the URL, operation and answer.
    """


class StoreUnreachableError(OpdStoreError, OSError):
    """The store cannot be used at all (no bucket, no credentials, no connection, an endpoint timing
    out, a local root that cannot be created or written); names the URL, the operation and the cause.
    """


class DistributedUnreachableError(DistributedSaveError, StoreUnreachableError):
    """A multi-rank save every failing rank of which could not reach the store."""


class StoreNotFoundError(CheckpointNotFoundError):
    """A read found no store at all: the local root does not exist (a typo would otherwise look like
    an empty store). Only reads raise it; a save creates the root.
    """


class ResumeMismatchError(OpdStoreError, ValueError):
    """A checkpoint cannot be resumed under the current config, provenance or world size."""


class UnsafeCheckpointError(OpdStoreError, ValueError):
    """Checkpoint state that weights-only loading could not restore, refused at save or load."""


class StreamTransformError(OpdStoreError, ValueError):
    """Items written through a stream transform (a DCP extension such as ``ZStandard``) this reader
    cannot apply; names URL, step, file and transform; raised before any tensor changes.
    """


class BackgroundSaveError(OpdStoreError, OSError):
    """An asynchronous save failed in the background; raised at the next save, ``wait`` or ``close``
    (the original is the ``__cause__``). Nothing committed, unless the cause is a
    :class:`RetentionError` (committed) or an :class:`AmbiguousCommitError` (maybe committed).
    """


class UploadError(BackgroundSaveError):
    """A tiered store's background work failed: an upload to the bucket (the step stays committed
    locally, not durable) or a retention pass after one; the failure is the ``__cause__``.
    """


class RetentionError(OpdStoreError, OSError):
    """A retention pass failed after the checkpoint it followed was committed (``url``, intact). Steps
    deleted stay deleted; an interrupted deletion leaves ``uncommitted`` at worst (the manifest goes
    first); the next pass or ``opd-store gc`` finishes it.

    Attributes:
        url (str | None): the committed checkpoint the pass followed, when there is one.
    """

    url: str | None = None

    @classmethod
    def after(cls, message: str, *, url: str | None) -> "RetentionError":
        error = cls(message)  # one argument: OSError would read two as (errno, strerror)
        error.url = url
        return error


class SaveInFlightError(OpdStoreError, RuntimeError):
    """A new asynchronous save was asked for while one is in flight, with ``when_busy="raise"``."""


class SaveAbandonedError(OpdStoreError, OSError):
    """An asynchronous save was abandoned uncommitted (its checkpointer closed or the interpreter
    exited before it finished, past the stated deadline)."""


class JournalEventError(OpdStoreError, ValueError):
    """A run-journal event object that cannot be read (oversized, not JSON, newer schema, not an
    event); names its URL and field. ``opd-store report`` skips it with a warning.
    """


class PriceTableError(OpdStoreError, ValueError):
    """A price file for ``opd-store report`` that does not parse: the message names the file and
    the field."""


__all__ = [
    "BackgroundSaveError",
    "JournalEventError",
    "PriceTableError",
    "SaveAbandonedError",
    "SaveInFlightError",
    "AmbiguousCommitError",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "CommitError",
    "DistributedAmbiguousCommitError",
    "DistributedCommitConflictError",
    "DistributedLoadError",
    "DistributedPermissionError",
    "DistributedSaveError",
    "DistributedUnreachableError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "PayloadUploadError",
    "ManifestError",
    "OpdStoreError",
    "RankFailedError",
    "ResumeMismatchError",
    "RetentionError",
    "StoragePermissionError",
    "StoreNotFoundError",
    "StoreRequestError",
    "StoreUnreachableError",
    "StreamTransformError",
    "ThrottledUploadError",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "UploadError",
]
