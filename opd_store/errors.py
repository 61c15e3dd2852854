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


class StoragePermissionError(OpdStoreError, PermissionError):
    """The backend refused a request for lack of permission (credentials, bucket policy). The
    message names the backend operation that was refused (``CreateMultipartUpload``, ``UploadPart``,
    ``PutObject`` on S3), the object URL and the step: a policy that allows ``PutObject`` but not
    the multipart operations fails only for payloads above the upload block size, which is hard to
    diagnose without the operation's name."""


class RankFailedError(OpdStoreError, OSError):
    """A collective operation of a multi-rank job failed on one or more ranks.

    Raised with the same message on every rank, so no rank carries on alone. On a failing rank the
    local exception is the ``__cause__``.

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
    """A multi-rank save whose manifest create may or may not have landed (the committing rank's
    :class:`AmbiguousCommitError`), raised on every rank: the step may be committed; ask
    ``is_complete`` later, as after a single save's ambiguous commit."""


class DistributedPermissionError(DistributedSaveError, StoragePermissionError):
    """A multi-rank save that failed because the backend refused every failing rank for lack of
    permission (each rank's :class:`StoragePermissionError` names the operation); also a
    ``PermissionError``."""


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
    """A read of the store failed after the client's retries with an answer that is neither a
    missing object nor a refusal for lack of permission: throttling (S3 ``SlowDown``, GCS 429) or a
    server error. The message names the URL, the operation and the backend's answer; the backend's
    error is the ``__cause__``. Nothing was changed by it."""


class StoreUnreachableError(OpdStoreError, OSError):
    """The store cannot be used at all: no such bucket, no credentials, no connection, an endpoint
    that does not answer within its timeout, a local root that cannot be created or written. The
    message names the URL, the operation and the cause; the backend's error is the ``__cause__``."""


class DistributedUnreachableError(DistributedSaveError, StoreUnreachableError):
    """A multi-rank save that failed because the store could not be reached by every failing rank
    (each rank's :class:`StoreUnreachableError` names the endpoint)."""


class StoreNotFoundError(CheckpointNotFoundError):
    """A read found no store at all: the local root directory does not exist (a typo looks like
    an empty store otherwise). A save creates the root; only reads raise this."""


class ResumeMismatchError(OpdStoreError, ValueError):
    """A checkpoint cannot be resumed under the current config, provenance or world size."""


class UnsafeCheckpointError(OpdStoreError, ValueError):
    """Checkpoint state that weights-only loading could not restore, refused at save or load."""


class StreamTransformError(OpdStoreError, ValueError):
    """A checkpoint's items were written through a stream transform (a DCP extension, such as
    ``ZStandard`` compression) that this reader cannot apply: unknown to its extension registry,
    or its package is not installed. Names the checkpoint URL, the step, the file and the
    transform; raised before any tensor changes."""


class BackgroundSaveError(OpdStoreError, OSError):
    """An asynchronous save failed in the background; reported at the next save, ``wait`` or
    ``close`` (the original exception is ``__cause__``). Nothing of that step was committed,
    unless the cause is a :class:`RetentionError` (the step committed; the retention pass after it
    failed) or an :class:`AmbiguousCommitError` (the step may have committed)."""


class UploadError(BackgroundSaveError):
    """A tiered store's background work failed: the upload of a locally committed step to the
    bucket, or a retention pass run after one. An upload failure leaves the step committed in the
    local tier and not durable (an :class:`AmbiguousCommitError` cause: the bucket's copy may have
    committed); the backend's, the copy's or the retention pass's error is the ``__cause__``."""


class RetentionError(OpdStoreError, OSError):
    """A retention pass could not run or failed part-way, after the checkpoint it followed was
    committed. The committed checkpoint is intact (``url``); steps deleted before the failure stay
    deleted, and a step whose deletion was interrupted is left ``uncommitted`` at worst (its
    manifest goes first). The next pass, or ``opd-store gc``, finishes the job. The backend's
    error is the ``__cause__``.

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
    """A run-journal event object that cannot be read: over the size limit, not JSON, of a newer
    schema, or not an event (the message names its URL and the field). ``opd-store report`` skips
    it with a warning; a resume never reads the journal's contents."""


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
    "StoreUnreachableError",
    "StreamTransformError",
    "ThrottledUploadError",
    "UnsafeCheckpointError",
    "UnsupportedBackendError",
    "UploadError",
]
