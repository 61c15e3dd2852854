"""The uploads of a tiered store: committed local steps copied to the bucket in the background.

Each locally committed step is one save of the store's :class:`~opd_store.pipeline.BackgroundSaves`
(the one owner of background saves), in commit order: :func:`opd_store.store._copy.copy_checkpoint` runs the commit protocol on the bucket
(payloads under a new attempt, each checked against the local manifest's size and CRC32C, the
bucket's manifest created only if absent, last), then the tier's retention runs through the one
executor's bounded pass after a save (:func:`opd_store.retention._after_save.apply_retention_after_save`): the bucket's own policy, then the local
tier's, with every local step that is not durable yet protected. Work that must wait for a step
to be durable (a save's retention, :meth:`TierUploads.when_durable`) is queued behind its upload.
A failure is raised by the tiered store at its next save, ``flush`` or ``close`` (and at
``wait_uploaded`` of a failed step), as :class:`~opd_store.errors.UploadError`; the owner runs
after every asynchronous save at interpreter exit (``EXIT_STAGE_UPLOADS``), since a save that
commits then queues its upload.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import RetentionError, UploadError
from ..pipeline import EXIT_STAGE_UPLOADS, BackgroundSaves, BackgroundTask
from ..retention import RetentionPolicy, apply_retention_after_save
from ..storage import describe
from ..store import CheckpointStore, DurableHook, copy_checkpoint

logger = logging.getLogger("opd_store.tiered")

_UPLOAD = "upload"
_AFTER = "after-upload"


class TierUploads:
    """The upload queue of one tiered store (see the module docstring).

    Args:
        local (CheckpointStore): the local tier.
        bucket (CheckpointStore): the bucket.
        local_retention (RetentionPolicy): applied to the local tier after each upload.
        bucket_retention (Callable[[], RetentionPolicy | None]): the bucket's own policy, read at
            each upload (the store's attribute may change between runs).
        upload_callback (Callable[[int], Any] | None): called with the step before each upload;
            its result receives the copy's progress (:class:`opd_store.store._copy.Progress`).
        exit_timeout_secs (float): the exit deadline of the uploads.
        owner (str): the tiered store in words, for errors.
    """

    def __init__(self, local: CheckpointStore, bucket: CheckpointStore, *, local_retention: RetentionPolicy,
                 bucket_retention: Callable[[], RetentionPolicy | None],
                 upload_callback: Callable[[int], Any] | None, exit_timeout_secs: float, owner: str) -> None:
        self.local = local
        self.bucket = bucket
        self.local_retention = local_retention
        self._bucket_retention = bucket_retention
        self.upload_callback = upload_callback
        kept = f"it stays uncommitted there; the local tier {local.url} keeps it (upload_pending() queues it on the next start)"
        self.saves = BackgroundSaves(f"opd-store-upload-{id(self):x}", exit_timeout_secs=exit_timeout_secs,
                                     exit_stage=EXIT_STAGE_UPLOADS, owner=owner, error=UploadError, abandoned_note=kept)
        self._lock = threading.Lock()
        self._tasks: dict[int, BackgroundTask] = {}
        self._uploaded: dict[int, str] = {}
        self._failed: dict[int, BaseException] = {}

    # -- queueing ------------------------------------------------------------------------------
    def enqueue(self, step: int) -> None:
        """Queue the upload of the committed local ``step``.

        Raises:
            ValueError: the store was closed.
        """
        with self._lock:
            self._failed.pop(step, None)
        task = self.saves.submit(f"upload of step {step} to {self.bucket.url}", (_UPLOAD, step),
                                 lambda: self._upload(step))
        with self._lock:
            self._tasks[step] = task

    def when_durable(self, step: int, hook: DurableHook) -> None:
        """Run ``hook(bucket)`` on the worker once ``step``'s upload (queued before) succeeded; a
        hook failure is raised at the next save, ``flush`` or ``close``. Nothing runs when the
        upload failed (that failure is the one reported)."""

        def run() -> None:
            with self._lock:
                uploaded = step in self._uploaded
            if uploaded or self.bucket.is_complete(step):
                hook(self.bucket)

        self.saves.submit(f"retention after the upload of step {step}", (_AFTER, step), run, follow_up=True)

    def _upload(self, step: int) -> str:
        try:
            callback = self.upload_callback(step) if self.upload_callback is not None else None
            url = copy_checkpoint(self.local, step, self.bucket, callback=callback, verify_deep=False,
                                  cancelled=self.saves.cancelled)
        except BaseException as exc:
            logger.error("upload of step %d from %s to %s failed: %r", step, self.local.url, self.bucket.url, exc)
            with self._lock:
                self._failed[step] = exc
            raise
        logger.info("step %d is durable at %s", step, url)
        with self._lock:
            self._uploaded[step] = url
        self._apply_tier_retention(step)
        return url

    def _apply_tier_retention(self, step: int) -> None:
        """The tier's own retention after the upload of ``step``: the bucket's policy (if any), then
        the local tier's with every step that is not durable protected. Both run; the first
        failure is raised (as :class:`RetentionError`) once both had their turn."""
        failures: list[BaseException] = []
        passes = ((self.bucket, self._bucket_retention(), frozenset()),
                  (self.local, self.local_retention, None))
        for tier, policy, not_durable in passes:
            if policy is None or policy.keeps_all:
                continue
            try:
                protected = self.local_protected() if not_durable is None else not_durable
                apply_retention_after_save(tier, policy, just_committed=step if tier is self.bucket else None,
                                           not_durable=protected)
            except Exception as exc:  # noqa: BLE001 - raised below, after the other tier's pass
                failures.append(RetentionError.after(
                    f"retention {policy!r} on {tier.url} after the upload of step {step} failed ({describe(exc)})",
                    url=self._uploaded.get(step)))
                failures[-1].__cause__ = exc
        if failures:
            raise failures[0]

    # -- state ---------------------------------------------------------------------------------
    def pending_steps(self) -> list[int]:
        """Steps queued or in flight for upload, in upload order."""
        return [task.key[1] for task in self.saves.pending() if task.key[0] == _UPLOAD]

    def known(self, step: int) -> bool:
        """Whether this store queued, uploaded or failed ``step``."""
        with self._lock:
            return step in self._tasks or step in self._uploaded or step in self._failed

    def uploaded_steps(self) -> set[int]:
        with self._lock:
            return set(self._uploaded)

    def failed_steps(self) -> set[int]:
        with self._lock:
            return set(self._failed)

    def local_protected(self) -> frozenset[int]:
        """Local steps that are not durable: queued or uploading, failed in this process, or absent
        from the bucket and newer than its newest committed step.

        A local step older than the bucket's newest committed step and absent from the bucket was
        deleted there by the bucket's retention (or superseded after a failed upload in an earlier
        process); :meth:`TieredStore.upload_pending` does not upload such a step either, so
        protecting it would keep it on local disk forever whenever the bucket keeps fewer steps
        than the local tier.
        """
        in_bucket = set(self.bucket.steps())  # committed there: its manifest exists (one listing)
        newest_durable = max(in_bucket, default=-1)
        busy = set(self.pending_steps()) | self.failed_steps()
        return frozenset(
            step for step in self.local.steps()
            if step in busy or (step not in in_bucket and step > newest_durable)
        )

    def wait_uploaded(self, step: int, timeout_secs: float | None) -> str:
        """Wait for the upload of a ``step`` this store queued; return its bucket URL.

        Raises:
            UploadError: that upload failed (the cause chained); it counts as reported.
            TimeoutError: still uploading after ``timeout_secs``.
        """
        with self._lock:
            task = self._tasks.get(step)
        if task is not None and not task.wait(timeout_secs):
            raise TimeoutError(f"step {step} is still uploading to {self.bucket.url} after {timeout_secs} s")
        with self._lock:
            url, failure = self._uploaded.get(step), self._failed.get(step)
        if url is not None:
            return url
        if task is not None:
            task.mark_reported()
        raise UploadError(f"upload of step {step} to {self.bucket.url} failed: {failure!r}") from failure

    def raise_unreported(self, at: str) -> None:
        """Raise every background failure not raised yet, once, as one :class:`UploadError` naming
        the store and each failure (the first is the ``__cause__``); ``at``: the sync point in words."""
        self.saves.raise_unreported(at)

    def wait_for_room(self, limit: int) -> None:
        """Block until fewer than ``limit`` uploads are queued or in flight."""
        self.saves.wait_until(lambda: len(self.pending_steps()) < limit)

    def flush(self, timeout_secs: float | None) -> None:
        """Wait for every queued upload and hook, then raise what failed (see :meth:`raise_unreported`).

        Raises:
            UploadError: a failure nobody saw.
            TimeoutError: still running after ``timeout_secs`` (names them).
        """
        self.saves.sync("flush()", timeout_secs=timeout_secs)

    def close(self, timeout_secs: float | None) -> None:
        """Flush, then stop the upload thread (see :meth:`BackgroundSaves.close
        <opd_store.pipeline.BackgroundSaves.close>`: past ``timeout_secs`` the uploads are abandoned)."""
        self.saves.close(timeout_secs)


__all__ = ["TierUploads"]
