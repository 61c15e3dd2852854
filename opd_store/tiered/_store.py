"""A tiered store: commit to a local directory first, then upload to the bucket in the background
(docs/tiered.md).

A save runs the commit protocol on the local tier and returns once that commit landed; the commit
queues the step's upload (:mod:`opd_store.tiered._uploads`), the same protocol on the bucket.
*Available* means complete in either tier (read locally when both copies match); *durable* means
complete in the bucket. An upload failure is raised as ``UploadError`` at the next save,
``flush``, ``close`` or ``wait_uploaded``, never only logged.
"""

from __future__ import annotations

import logging
import os
from typing import Any, BinaryIO, Callable

from ..errors import CheckpointNotFoundError, CommitConflictError
from ..format import Manifest
from ..retention import RetentionPolicy, check_retention
from ..store import BaseStore, CheckpointInfo, CheckpointStore, DurableHook, RetentionTier, VerifyReport
from ._routing import BucketCheck, merge_checkpoints, pick_tier, same_payloads
from ._uploads import TierUploads

logger = logging.getLogger("opd_store.tiered")


class TieredStore(BaseStore):
    """A local-disk tier in front of a bucket: saves commit locally, then upload in the background.

    Args:
        local (str | os.PathLike | CheckpointStore): the local tier, a directory (created on the
            first save). Use a directory of its own per run; ``memory://`` works for tests.
        bucket (str | os.PathLike | CheckpointStore): the durable tier: any store URL
            (``s3://``, ``gs://``, a local path, ...).
        storage_options (dict | None): fsspec options for ``bucket`` when it is a URL.
        local_retention (RetentionPolicy | None): applied to the local tier after each upload,
            with every step that is not yet durable protected. Default
            ``RetentionPolicy(keep_last=local_keep_last)``.
        local_keep_last (int): complete local steps kept by the default local retention (2).
        bucket_retention (RetentionPolicy | None): applied to the bucket after each upload;
            ``None`` keeps every bucket step (a save's own ``retention=`` then applies there).
        max_pending_uploads (int | None): when this many uploads are queued or in flight, a new
            save waits for one to finish before it starts (bounds the local disk and the
            durability lag); ``None`` never waits.
        upload_callback (Callable[[int], Progress] | None): called with the step
            before each upload; its result receives the upload's progress (:class:`opd_store.store._copy.Progress`).
        exit_timeout_secs (float): at interpreter exit, wait this long for queued uploads, then
            abandon them (their bucket attempt stays uncommitted; the local copy is uploaded by
            :meth:`upload_pending` on the next start).

    Raises:
        TypeError: a tier is itself a :class:`TieredStore`, or a retention is not a policy.
        ValueError: both tiers are the same URL, or a bad ``local_keep_last``.
    """

    def __init__(
        self,
        local: str | os.PathLike | CheckpointStore,
        bucket: str | os.PathLike | CheckpointStore,
        *,
        storage_options: dict[str, Any] | None = None,
        local_retention: RetentionPolicy | None = None,
        local_keep_last: int = 2,
        bucket_retention: RetentionPolicy | None = None,
        max_pending_uploads: int | None = None,
        upload_callback: Callable[[int], Any] | None = None,
        exit_timeout_secs: float = 60.0,
    ) -> None:
        if isinstance(local, TieredStore) or isinstance(bucket, TieredStore):
            raise TypeError("a tier of a TieredStore must be a plain CheckpointStore")
        self.local = local if isinstance(local, CheckpointStore) else CheckpointStore(local)
        self.bucket = bucket if isinstance(bucket, CheckpointStore) else CheckpointStore(
            bucket, storage_options=storage_options
        )
        if self.local.url == self.bucket.url:
            raise ValueError(f"the local tier and the bucket are the same store: {self.local.url}")
        if max_pending_uploads is not None and max_pending_uploads < 1:
            raise ValueError(f"max_pending_uploads must be >= 1 or None, got {max_pending_uploads!r}")
        local_policy = check_retention(local_retention, "local_retention") or RetentionPolicy(keep_last=local_keep_last)
        self.bucket_retention = check_retention(bucket_retention, "bucket_retention")
        self.max_pending_uploads = max_pending_uploads
        self.uploads = TierUploads(self.local, self.bucket, local_retention=local_policy,
                                   bucket_retention=lambda: self.bucket_retention, upload_callback=upload_callback,
                                   exit_timeout_secs=exit_timeout_secs, owner=repr(self))
        self._closed = False

    def under(self, name: str) -> "TieredStore":
        """The tiered store of the checkpoints under ``name``: ``<local>/<name>`` in front of
        ``<bucket>/<name>`` (each tier reopened by its URL), with this store's retention, upload
        and exit settings and an upload queue of its own (close it when done).

        Raises:
            ValueError: ``name`` is empty, absolute or climbs out of the tiers (``..``).
        """
        parts = name.split("/")
        if not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{name!r} is not a relative name under {self!r}")
        return TieredStore(
            f"{self.local.url.rstrip('/')}/{name}",
            CheckpointStore(f"{self.bucket.url.rstrip('/')}/{name}", storage_options=self.bucket.storage_options),
            local_retention=self.local_retention, bucket_retention=self.bucket_retention,
            max_pending_uploads=self.max_pending_uploads, upload_callback=self.uploads.upload_callback,
            exit_timeout_secs=self.uploads.saves.exit_timeout_secs,
        )

    @property
    def local_retention(self) -> RetentionPolicy:
        """The local tier's retention policy."""
        return self.uploads.local_retention

    # -- identity ------------------------------------------------------------------------------
    @property
    def storage_options(self) -> dict[str, Any]:
        """The bucket's fsspec options (a local path ignores them)."""
        return self.bucket.storage_options

    @property
    def url(self) -> str:
        """The bucket's URL: the store a run is identified by (the local tier is a cache of it)."""
        return self.bucket.url

    def __repr__(self) -> str:
        return f"TieredStore(local={self.local.url!r}, bucket={self.bucket.url!r})"

    def check_reachable(self, *, write: bool = True, timeout_secs: float | None = None) -> None:
        """Check both tiers, the local one first (see :meth:`CheckpointStore.check_reachable`).

        Raises:
            StoreUnreachableError: either tier cannot be used; the message names its URL.
            StoreNotFoundError: a read-only check of a local tier that does not exist.
        """
        self.local.check_reachable(write=write, timeout_secs=timeout_secs)
        self.bucket.check_reachable(write=write, timeout_secs=timeout_secs)

    # -- choosing a tier -----------------------------------------------------------------------
    def tiers(self) -> list[CheckpointStore]:
        """``[local, bucket]``: the plain stores reads come from."""
        return [self.local, self.bucket]

    def tier_for(self, step: int) -> CheckpointStore:
        """The tier reads of ``step`` go to (see :func:`opd_store.tiered._routing.pick_tier`)."""
        return pick_tier(self.local, self.bucket, step)

    def step_url(self, step: int) -> str:
        """URL of ``step`` in the tier it is read from (:meth:`tier_for`): a local path when the
        local copy is preferred, else the bucket URL (also for a step in neither tier)."""
        return self.tier_for(step).step_url(step)

    # -- reads (available in either tier) ------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a manifest in either tier, ascending."""
        return sorted(set(self.local.steps()) | set(self.bucket.steps()))

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every step of either tier with its status, as the tier :meth:`tier_for` would pick
        reports it (see :func:`opd_store.tiered._routing.merge_checkpoints`)."""
        return merge_checkpoints(self.local.checkpoints(), self.bucket.checkpoints())

    def is_complete(self, step: int) -> bool:
        """True when ``step`` is complete in either tier."""
        return self.local.is_complete(step) or self.bucket.is_complete(step)

    def status(self, step: int) -> str:
        """``step``'s status in the tier it would be read from (:meth:`tier_for`)."""
        return self.tier_for(step).status(step)

    def latest_step(self) -> int:
        """The newest step complete in either tier (durable or not; see :meth:`latest_durable_step`).

        Raises:
            CheckpointNotFoundError: no complete step in either tier (names both URLs).
        """
        found, reasons = [], []
        for tier in (self.local, self.bucket):
            try:
                found.append(tier.latest_step())
            except CheckpointNotFoundError as exc:
                reasons.append(str(exc))
        if not found:
            raise CheckpointNotFoundError("no complete checkpoint in either tier: " + "; ".join(reasons))
        return max(found)

    def manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` in the tier it is read from (see :meth:`CheckpointStore.manifest`)."""
        return self.tier_for(step).manifest(step)

    def names(self, step: int) -> list[str]:
        """Payload names of ``step`` (see :meth:`CheckpointStore.names`)."""
        return self.tier_for(step).names(step)

    def read(self, step: int, name: str, *, manifest: Manifest | None = None) -> bytes:
        """Verified bytes of a payload, from the tier :meth:`tier_for` picks (see
        :meth:`CheckpointStore.read` for the errors)."""
        with self.open(step, name, manifest=manifest) as reader:
            return reader.read()

    def open(self, step: int, name: str, *, manifest: Manifest | None = None) -> BinaryIO:
        """A verified reader of a payload (see :meth:`CheckpointStore.open`). A given ``manifest``
        must be the manifest of the tier :meth:`tier_for` picks (its paths name that tier's
        attempt); the one from :meth:`manifest` is."""
        tier = self.tier_for(step)
        if manifest is not None and tier.manifest(step).attempt_id != manifest.attempt_id:
            manifest = None
        return tier.open(step, name, manifest=manifest)

    def verify(self, step: int, *, deep: bool = False, keep=None) -> VerifyReport:
        """Verify ``step`` in the tier it is read from (see :meth:`CheckpointStore.verify`)."""
        return self.tier_for(step).verify(step, deep=deep, keep=keep)

    # -- durability ------------------------------------------------------------------------------
    def durable_steps(self) -> list[int]:
        """Steps complete in the bucket, ascending: what a new machine with an empty local tier sees."""
        return self.bucket.durable_steps()

    def latest_durable_step(self) -> int:
        """The newest step complete in the bucket.

        Raises:
            CheckpointNotFoundError: no complete step in the bucket.
        """
        return self.bucket.latest_step()

    def is_durable(self, step: int) -> bool:
        """True when ``step`` is complete in the bucket."""
        return self.bucket.is_complete(step)

    def local_steps(self) -> list[int]:
        """Steps complete in the local tier, ascending (available here, durable or not)."""
        return self.local.durable_steps()

    def pending_uploads(self) -> list[int]:
        """Steps queued or in flight for upload by this store, in upload order."""
        return self.uploads.pending_steps()

    def when_durable(self, step: int, hook: DurableHook) -> None:
        """Run ``hook(self.bucket)`` on the upload worker once ``step``'s upload (queued by its
        commit) succeeded; a failure is raised at the next save, ``flush`` or ``close``."""
        self.uploads.when_durable(step, hook)

    def upload_pending(self) -> list[int]:
        """Queue the upload of every complete local step newer than the bucket's newest complete
        step and absent from the bucket (a previous process committed it locally and died before
        its upload finished, or its upload failed). Older local-only steps are left alone: the
        bucket's retention may have deleted them on purpose. Returns the steps queued."""
        try:
            newest = self.bucket.latest_step()
        except CheckpointNotFoundError:
            newest = -1
        in_bucket = set(self.bucket.steps())
        busy = set(self.uploads.pending_steps()) | self.uploads.uploaded_steps()
        queued = [s for s in self.local_steps() if s > newest and s not in in_bucket and s not in busy]
        for step in queued:
            self.uploads.enqueue(step)
        return queued

    def wait_uploaded(self, step: int, timeout_secs: float | None = None) -> str:
        """Block until ``step`` is durable in the bucket (queuing a complete local step this store never
        queued); return its bucket URL.

        Raises:
            UploadError: the upload of ``step`` failed (the cause is chained).
            TimeoutError: still uploading after ``timeout_secs``.
            CheckpointNotFoundError: ``step`` is complete in neither tier.
        """
        if not self.uploads.known(step):
            if self.bucket.is_complete(step):
                return self.bucket.step_url(step)
            if not self.local.is_complete(step):
                raise CheckpointNotFoundError(
                    f"step {step} is complete in neither {self.local.url} nor {self.bucket.url}"
                )
            self.uploads.enqueue(step)
        return self.uploads.wait_uploaded(step, timeout_secs)

    def flush(self, timeout_secs: float | None = None) -> None:
        """Block until every queued upload finished; raise the failures not raised yet.

        Raises:
            UploadError: an upload (or a retention pass run after one) failed since the last time
                a failure was raised; the first failure is the ``__cause__``, all are named.
            TimeoutError: uploads still running after ``timeout_secs`` (named).
        """
        self.uploads.flush(timeout_secs)

    def close(self, timeout_secs: float | None = None) -> None:
        """Flush (see :meth:`flush`, same errors) and stop the upload thread; past ``timeout_secs``
        the uploads still running are abandoned (the local tier keeps their steps). Saves are
        refused afterwards; reads still work. Safe to call twice."""
        self._closed = True
        self.uploads.close(timeout_secs)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with an upload failure
            try:
                self.close()
            except Exception:  # noqa: BLE001
                logger.error("upload failure while closing %r after another error", self, exc_info=True)

    # -- retention -------------------------------------------------------------------------------
    def durable_store(self) -> CheckpointStore:
        """The bucket: a step is durable once it is complete there."""
        return self.bucket

    def retention_tiers(self, policy: Any) -> list[RetentionTier]:
        """The bucket with ``policy``, then the local tier with its own policy and every step that
        is not durable yet protected."""
        return [RetentionTier(self.bucket, policy),
                RetentionTier(self.local, self.local_retention, self.uploads.local_protected())]

    def check_save_retention(self, policy: Any) -> None:
        """Refuse a save's policy while :attr:`bucket_retention` is set: both would prune the bucket.

        Raises:
            ValueError: naming both policies.
        """
        if self.bucket_retention is not None:
            raise ValueError(f"{self!r} already has bucket retention {self.bucket_retention!r}; "
                             f"pass retention={policy!r} to one of them, not both")

    # -- writes --------------------------------------------------------------------------------
    def begin(self, step: int, *, world_size: int = 1, metadata: dict[str, Any] | None = None,
              attempt_id: str | None = None, rank: int = 0):
        """Start a save of ``step`` in the local tier (:meth:`CheckpointStore.begin`'s arguments); its
        commit returns the local URL once the local manifest landed and queues the upload.

        Raises:
            UploadError: an earlier upload (or retention run) failed; raised once, before anything is
                written.
            CommitConflictError: ``step`` is committed (or legacy) locally (here) or in the bucket (at
                the commit; a bucket that cannot be asked is logged and the upload raises any conflict).
            ValueError: the store was closed.
            UnsupportedBackendError: see :meth:`CheckpointStore.begin`.
        """
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        self.uploads.raise_unreported("the next save")
        if self.max_pending_uploads is not None:
            self.uploads.wait_for_room(self.max_pending_uploads)
        txn = self.local.begin(step, world_size=world_size, metadata=metadata, attempt_id=attempt_id, rank=rank)
        # Whether the bucket already holds the step is asked while the payloads stream to local
        # disk (requests that would otherwise add their latency to every save) and decided
        # before the local commit.
        check = BucketCheck(self.bucket, step)

        def refuse_if_in_bucket() -> None:
            if check.in_bucket():
                raise CommitConflictError(
                    f"checkpoint already exists: {self.bucket.step_url(step)} (step {step} is in the bucket)"
                )

        txn.on_commit(before=refuse_if_in_bucket, after=lambda _url: self.uploads.enqueue(step))
        return txn

    def begin_part(self, step: int, *, attempt_id: str, rank: int, world_size: int):
        """Start one rank's part of a multi-rank save in the local tier (see
        :meth:`CheckpointStore.begin_part`). Rank obligations: every rank sees the same local
        directory (one machine); rank 0's commit queues the upload of the whole step."""
        return self.local.begin_part(step, attempt_id=attempt_id, rank=rank, world_size=world_size)

    def delete(self, step: int) -> None:
        """Delete ``step`` from the bucket, then from the local tier.

        Raises:
            ValueError: ``step`` is queued or in flight for upload (wait for it first).
        """
        if step in self.pending_uploads():
            raise ValueError(f"step {step} is being uploaded to {self.bucket.url}; wait_uploaded({step}) first")
        self.bucket.delete(step)
        self.local.delete(step)


__all__ = ["TieredStore", "same_payloads"]
