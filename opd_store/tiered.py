"""A tiered store: commit to a local directory first, then upload to the bucket in the background.

Issue 8, item 3. A save through :class:`TieredStore` runs the ordinary commit protocol against a
:class:`~opd_store.store.CheckpointStore` on local disk (payloads under a new attempt, fsync,
create-only manifest) and returns as soon as that local commit landed. A single background thread
then copies the step to the bucket with :func:`opd_store.transfer.copy_checkpoint`, which runs the
same protocol there: payloads under a new attempt of the bucket, each checked against the local
manifest's size and CRC32C, and the bucket's manifest created only if absent, last. The bucket's
manifest therefore records the same payload names, sizes and CRC32Cs as the local one.

Two questions, two answers:

* *available* (``latest_step()``, ``steps()``, reads): complete in either tier. A step complete in
  both tiers with the same payload entries is read from local disk (no payload request to the
  bucket); when the entries differ, the bucket's copy wins (it is the durable one) and a warning
  is logged.
* *durable* (``durable_steps()``, ``latest_durable_step()``, ``is_durable()``,
  ``wait_uploaded()``): complete in the bucket. A step whose upload has not finished is never
  durable, whatever the local tier holds; a new machine with an empty local tier sees exactly the
  durable steps.

An upload failure is never only logged: it is raised as :class:`~opd_store.errors.UploadError` at
the next ``begin`` (the next save), at ``flush``, at ``close`` and at ``wait_uploaded`` of that
step. Retention runs per tier after each successful upload, through one hook per tier.

The tiered store is a :class:`~opd_store.store.CheckpointStore` (same read and transaction API),
so the OPD layer (``save_opd_checkpoint``, ``load_opd_checkpoint`` through ``(store, step)``,
``latest_complete_checkpoint``) and the main job accept it where they accept a store. It is a
single-writer store: one process saves (rank 0 in the OPD layer's single-writer mode).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, BinaryIO, Callable

from . import exit_hooks
from .errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ManifestError,
    UploadError,
)
from .layout import LEGACY_MARKER, MANIFEST_NAME, step_dirname
from .manifest import Manifest
from .store import COMPLETE, LEGACY, CheckpointInfo, CheckpointStore, VerifyReport
from .thread_random import route_background_random
from .transfer import copy_checkpoint

logger = logging.getLogger("opd_store.tiered")

RetentionHook = Callable[[CheckpointStore, frozenset], object]
"""A per-tier retention hook: ``hook(tier_store, protected_steps)``.

It may delete steps of ``tier_store`` (with ``tier_store.delete(step)``) but must never delete a
step in ``protected_steps`` (for the local tier: every step not yet durable in the bucket). Issue
6's retention policies plug in through :class:`opd_store.gc.TierRetention`."""


class KeepLastN:
    """The local tier's default retention: keep the newest ``keep_last`` complete local steps.

    Steps outside the newest ``keep_last`` are deleted from the local tier only when they are not
    protected (for the local tier: only once their bucket copy is durable), so a step is never lost
    from both tiers. Any :data:`RetentionHook` replaces it; :class:`opd_store.gc.TierRetention`
    applies issue 6's retention policies (keep-last, keep-every, pins) to a tier.

    Args:
        keep_last (int): complete steps to keep, >= 1.

    Raises:
        ValueError: ``keep_last`` < 1.
    """

    def __init__(self, keep_last: int) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.keep_last = keep_last

    def __call__(self, store: CheckpointStore, protected_steps: frozenset) -> list[int]:
        complete = [info.step for info in store.checkpoints() if info.status == COMPLETE]
        doomed = [step for step in complete[: -self.keep_last] if step not in protected_steps]
        for step in doomed:
            store.delete(step)
        return doomed

    def __repr__(self) -> str:
        return f"KeepLastN({self.keep_last})"


def same_payloads(a: Manifest, b: Manifest) -> bool:
    """True when two manifests name the same payloads with the same sizes and CRC32Cs.

    Attempt ids (hence paths), writers and commit times may differ: a bucket copy made by
    :func:`~opd_store.transfer.copy_checkpoint` matches its local original.
    """
    def key(manifest: Manifest) -> set[tuple[str, int, str]]:
        return {(entry.name, entry.size_bytes, entry.crc32c) for entry in manifest.payloads}

    return a.step == b.step and key(a) == key(b)


class _BucketCheck:
    """Asks, in a thread of its own, whether the bucket holds a manifest (or a legacy marker) for
    ``step``; :meth:`in_bucket` waits for the answer. A bucket that cannot be asked answers
    ``False`` with a warning: the local tier exists so that saves do not depend on the bucket
    being reachable right now, and the upload's create-only commit still refuses a conflict."""

    def __init__(self, bucket: CheckpointStore, step: int) -> None:
        self._bucket = bucket
        self._step = step
        self._answer = False
        self._thread = threading.Thread(target=self._run, name=f"opd-store-check-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # One delimiter listing of the step prefix (one request on S3 and GCS). A small save
            # (a LoRA adapter) finishes its local write before the bucket answers, so this latency
            # is what a tiered save adds to a plain one: two `size()` calls cost four requests on
            # s3fs (a HEAD, then a LIST for a missing key) and 95 ms against moto
            # (`python -m bench.tiered --overhead-only`).
            _prefixes, files = self._bucket.storage.list_children(step_dirname(self._step))
            self._answer = MANIFEST_NAME in files or LEGACY_MARKER in files
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            logger.warning("could not check %s for step %d before saving: %r", self._bucket.url, self._step, exc)

    def in_bucket(self) -> bool:
        self._thread.join()
        return self._answer


class _TieredTransaction:
    """The local tier's :class:`~opd_store.transaction.Transaction`, whose commit also queues the
    step's upload. Every other attribute (``open``, ``write_bytes``, ``entries``, ``abort``,
    ``url``, ``attempt_id``, ...) is the local transaction's."""

    def __init__(self, inner, tiered: "TieredStore", check: "_BucketCheck") -> None:
        self._inner = inner
        self._tiered = tiered
        self._check = check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def commit(self) -> str:
        """Commit locally (the ordinary protocol), queue the upload, return the local URL.

        Raises:
            CommitConflictError: the bucket already holds the step (nothing is committed; this
                attempt's local payloads are deleted).
            The local transaction's commit errors (see :meth:`Transaction.commit`).
        """
        if self._check.in_bucket():
            self._inner.abort()
            raise CommitConflictError(
                f"checkpoint already exists: {self._tiered.bucket.step_url(self._inner.step)} "
                f"(step {self._inner.step} is in the bucket)"
            )
        url = self._inner.commit()
        self._tiered._enqueue(self._inner.step)
        return url

    def __enter__(self) -> "_TieredTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self._inner.abort()


class TieredStore(CheckpointStore):
    """A local-disk tier in front of a bucket: saves commit locally, then upload in the background.

    Args:
        local (str | os.PathLike | CheckpointStore): the local tier, a directory (created on the
            first save). Use a directory of its own per run; ``memory://`` works for tests.
        bucket (str | os.PathLike | CheckpointStore): the durable tier: any store URL
            (``s3://``, ``gs://``, a local path, ...).
        storage_options (dict | None): fsspec options for ``bucket`` when it is a URL.
        local_retention (RetentionHook | None): run on the local tier after each upload, with
            every step that is not yet durable protected. Default ``KeepLastN(local_keep_last)``.
        local_keep_last (int): complete local steps kept by the default local retention (2).
        bucket_retention (RetentionHook | None): run on the bucket after each upload (nothing
            protected); ``None`` keeps every bucket step.
        max_pending_uploads (int | None): when this many uploads are queued or in flight, a new
            save waits for one to finish before it starts (bounds the local disk and the
            durability lag); ``None`` never waits.
        upload_callback (Callable[[int], fsspec.callbacks.Callback] | None): called with the step
            before each upload; its callback receives the upload's progress (``TqdmCallback``).
        exit_timeout_secs (float): at interpreter exit, wait this long for queued uploads, then
            abandon them (their bucket attempt stays uncommitted; the local copy is uploaded by
            :meth:`upload_pending` on the next start).

    Raises:
        TypeError: a tier is itself a :class:`TieredStore`.
        ValueError: both tiers are the same URL, or a bad ``local_keep_last``.
    """

    def __init__(
        self,
        local: str | os.PathLike | CheckpointStore,
        bucket: str | os.PathLike | CheckpointStore,
        *,
        storage_options: dict[str, Any] | None = None,
        local_retention: RetentionHook | None = None,
        local_keep_last: int = 2,
        bucket_retention: RetentionHook | None = None,
        max_pending_uploads: int | None = None,
        upload_callback: Callable[[int], Any] | None = None,
        exit_timeout_secs: float = 60.0,
    ) -> None:
        self.local = local if isinstance(local, CheckpointStore) else CheckpointStore(local)
        self.bucket = bucket if isinstance(bucket, CheckpointStore) else CheckpointStore(
            bucket, storage_options=storage_options
        )
        if isinstance(self.local, TieredStore) or isinstance(self.bucket, TieredStore):
            raise TypeError("a tier of a TieredStore must be a plain CheckpointStore")
        if self.local.url == self.bucket.url:
            raise ValueError(f"the local tier and the bucket are the same store: {self.local.url}")
        if max_pending_uploads is not None and max_pending_uploads < 1:
            raise ValueError(f"max_pending_uploads must be >= 1 or None, got {max_pending_uploads!r}")
        self.local_retention = local_retention if local_retention is not None else KeepLastN(local_keep_last)
        self.bucket_retention = bucket_retention
        self.max_pending_uploads = max_pending_uploads
        self.upload_callback = upload_callback
        self.exit_timeout_secs = exit_timeout_secs
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._in_flight: int | None = None
        self._uploaded: dict[int, str] = {}
        self._failed: dict[int, BaseException] = {}
        self._unreported: list[tuple[str, BaseException]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        # At interpreter exit, while remote stores still work (see opd_store.exit_hooks).
        exit_hooks.register(_close_at_exit, weakref.ref(self))

    # -- identity ------------------------------------------------------------------------------
    @property
    def storage(self):  # noqa: D401 - a guard, not an API
        """Not available: a tiered store has two storages (``.local.storage``, ``.bucket.storage``)."""
        raise TypeError("a TieredStore has two storages: use .local.storage or .bucket.storage")

    @property
    def storage_options(self) -> dict[str, Any]:
        """The bucket's fsspec options (a local path ignores them)."""
        return self.bucket.storage_options

    @classmethod
    def from_storage(cls, storage) -> "TieredStore":
        raise TypeError("TieredStore(local, bucket) takes two stores; from_storage builds a plain CheckpointStore")

    @property
    def url(self) -> str:
        """The bucket's URL: the store a run is identified by (the local tier is a cache of it)."""
        return self.bucket.url

    def __repr__(self) -> str:
        return f"TieredStore(local={self.local.url!r}, bucket={self.bucket.url!r})"

    def check_reachable(self) -> None:
        """Check both tiers (see :meth:`CheckpointStore.check_reachable`).

        Raises:
            StoreUnreachableError: either tier cannot be used; the message names its URL.
        """
        self.local.check_reachable()
        self.bucket.check_reachable()

    # -- choosing a tier -----------------------------------------------------------------------
    def tier_for(self, step: int) -> CheckpointStore:
        """The tier reads of ``step`` go to.

        The local tier when its copy is complete (or legacy) and the bucket has no manifest for
        the step or one naming the same payload entries (:func:`same_payloads`); the bucket
        otherwise (including when the local copy differs from a complete bucket copy: the
        bucket is the durable one, and a warning names both URLs); the local tier again when the
        bucket's differing copy is not complete, or the bucket cannot be asked (logged). Costs a
        local check and one small bucket read (the manifest), never a payload read.
        """
        local_status, local_manifest, _ = self.local._status(step)
        if local_status not in (COMPLETE, LEGACY):
            return self.bucket
        try:
            bucket_manifest = self.bucket._read_manifest(step)
        except ManifestError:
            return self.local
        except OSError as exc:
            # The local copy is complete and every read of it is checked (size, CRC32C): a
            # bucket that cannot be asked right now does not make it unreadable.
            logger.warning("could not read the manifest of step %d in %s (%r); reading the local copy",
                           step, self.bucket.url, exc)
            return self.local
        if bucket_manifest is None:
            return self.local
        if local_manifest is not None and same_payloads(local_manifest, bucket_manifest):
            return self.local
        if self.bucket.is_complete(step):
            logger.warning(
                "step %d differs between the local tier (%s) and the bucket (%s); reading the bucket's copy",
                step, self.local.step_url(step), self.bucket.step_url(step),
            )
            return self.bucket
        return self.local

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
        reports it (a complete copy wins over an incomplete one)."""
        local = {info.step: info for info in self.local.checkpoints()}
        bucket = {info.step: info for info in self.bucket.checkpoints()}
        merged = []
        for step in sorted(set(local) | set(bucket)):
            a, b = local.get(step), bucket.get(step)
            if a is not None and a.status == COMPLETE and (
                b is None or b.status != COMPLETE or (a.manifest and b.manifest and same_payloads(a.manifest, b.manifest))
            ):
                merged.append(a)
            elif b is not None and (b.status == COMPLETE or a is None or a.status != COMPLETE):
                merged.append(b)
            else:
                merged.append(a)
        return merged

    def is_complete(self, step: int) -> bool:
        """True when ``step`` is complete in either tier."""
        return self.local.is_complete(step) or self.bucket.is_complete(step)

    def status(self, step: int) -> str:
        """``step``'s status in the tier it would be read from (:meth:`tier_for`)."""
        return self.tier_for(step).status(step)

    def latest_step(self, *, include_legacy: bool = False) -> int:
        """The newest step complete in either tier (durable or not; see :meth:`latest_durable_step`).

        Args:
            include_legacy (bool): also accept seed-layout checkpoints, as the OPD layer does.

        Raises:
            CheckpointNotFoundError: no complete step in either tier (names both URLs).
        """
        found = []
        reasons = []
        for tier in (self.local, self.bucket):
            try:
                found.append(tier.latest_step(include_legacy=include_legacy))
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

    def verify(self, step: int, *, deep: bool = False) -> VerifyReport:
        """Verify ``step`` in the tier it is read from (see :meth:`CheckpointStore.verify`)."""
        return self.tier_for(step).verify(step, deep=deep)

    # -- durability ------------------------------------------------------------------------------
    def durable_steps(self) -> list[int]:
        """Steps complete in the bucket, ascending: what a new machine with an empty local tier sees."""
        return [info.step for info in self.bucket.checkpoints() if info.status == COMPLETE]

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
        return [info.step for info in self.local.checkpoints() if info.status == COMPLETE]

    def pending_uploads(self) -> list[int]:
        """Steps queued or in flight for upload by this store, in upload order."""
        with self._cond:
            return ([self._in_flight] if self._in_flight is not None else []) + list(self._queue)

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
        with self._cond:
            known = set(self._queue) | {self._in_flight} | set(self._uploaded)
        queued = [s for s in self.local_steps() if s > newest and s not in in_bucket and s not in known]
        for step in queued:
            self._enqueue(step)
        return queued

    def wait_uploaded(self, step: int, timeout_secs: float | None = None) -> str:
        """Block until ``step`` is durable in the bucket; return its bucket URL.

        A complete local step that this store never queued (committed by an earlier process) is
        queued first.

        Args:
            step (int): the step.
            timeout_secs (float | None): seconds to wait at most; ``None`` waits as long as it takes.

        Raises:
            UploadError: the upload of ``step`` failed (the cause is chained).
            TimeoutError: still uploading after ``timeout_secs``.
            CheckpointNotFoundError: ``step`` is complete in neither tier.
        """
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        with self._cond:
            known = step in self._queue or step == self._in_flight or step in self._uploaded or step in self._failed
        if not known:
            if self.bucket.is_complete(step):
                return self.bucket.step_url(step)
            if not self.local.is_complete(step):
                raise CheckpointNotFoundError(
                    f"step {step} is complete in neither {self.local.url} nor {self.bucket.url}"
                )
            self._enqueue(step)
        with self._cond:
            while step in self._queue or step == self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"step {step} is still uploading to {self.bucket.url} after {timeout_secs} s")
                self._cond.wait(remaining)
            if step in self._failed:
                exc = self._failed[step]
                self._unreported = [(m, e) for m, e in self._unreported if e is not exc]
                raise UploadError(f"upload of step {step} to {self.bucket.url} failed: {exc!r}") from exc
            return self._uploaded[step]

    def flush(self, timeout_secs: float | None = None) -> None:
        """Block until every queued upload finished; raise the failures not raised yet.

        Args:
            timeout_secs (float | None): seconds to wait at most; ``None`` waits as long as it takes.

        Raises:
            UploadError: an upload (or a retention hook run after one) failed since the last time
                a failure was raised; the first failure is the ``__cause__``, all are named.
            TimeoutError: uploads still running after ``timeout_secs``.
        """
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        with self._cond:
            while self._queue or self._in_flight is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"uploads of steps {self.pending_uploads()} to {self.bucket.url} still running after {timeout_secs} s"
                    )
                self._cond.wait(remaining)
        self._raise_unreported()

    def close(self, timeout_secs: float | None = None) -> None:
        """Flush (see :meth:`flush`, same errors) and stop the upload thread. Saves are refused
        afterwards; reads still work. Safe to call twice."""
        try:
            self.flush(timeout_secs)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout_secs)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with an upload failure
            try:
                self.close()
            except Exception:  # noqa: BLE001
                logger.error("upload failure while closing %r after another error", self, exc_info=True)

    def _raise_unreported(self) -> None:
        with self._cond:
            failures, self._unreported = self._unreported, []
        if failures:
            detail = "; ".join(f"{what}: {exc!r}" for what, exc in failures)
            raise UploadError(f"{len(failures)} background failure(s) of {self!r}: {detail}") from failures[0][1]

    # -- writes --------------------------------------------------------------------------------
    def begin_part(self, step: int, **kwargs: Any):
        """Not available: a tiered store has one writer (multi-rank parts, issue 7, need one store).

        Raises:
            TypeError: always; save multi-rank checkpoints to a plain :class:`CheckpointStore`.
        """
        raise TypeError(
            f"TieredStore({self.local.url}, {self.bucket.url}) takes single-writer saves only: multi-rank "
            f"parts (step {step}) need a plain CheckpointStore"
        )

    def begin(
        self,
        step: int,
        *,
        world_size: int = 1,
        metadata: dict[str, Any] | None = None,
        attempt_id: str | None = None,
        rank: int = 0,
    ):
        """Start a save of ``step`` in the local tier; its commit queues the upload.

        Same arguments as :meth:`CheckpointStore.begin`. The returned transaction commits with the
        ordinary protocol on local disk; ``commit()`` (or a clean ``with`` exit) returns the local
        checkpoint URL as soon as the local manifest landed.

        Raises:
            UploadError: an earlier background upload (or retention run) failed; raised once,
                before anything of this save is written.
            CommitConflictError: ``step`` is committed (or legacy) in the local tier (here) or in
                the bucket (at the commit: the bucket is asked while the payloads stream; a
                bucket that cannot be asked is logged and the save goes ahead, and the upload
                then raises any conflict).
            ValueError: the store was closed.
            UnsupportedBackendError: see :meth:`CheckpointStore.begin`.
        """
        with self._cond:
            if self._closed:
                raise ValueError(f"{self!r} is closed")
        self._raise_unreported()
        if self.max_pending_uploads is not None:
            with self._cond:
                while len(self._queue) + (self._in_flight is not None) >= self.max_pending_uploads:
                    self._cond.wait()
        txn = self.local.begin(step, world_size=world_size, metadata=metadata, attempt_id=attempt_id, rank=rank)
        # Whether the bucket already holds the step is asked while the payloads stream to local
        # disk (2-4 requests that would otherwise add their latency to every save) and decided
        # before the local commit.
        check = _BucketCheck(self.bucket, step)
        return _TieredTransaction(txn, self, check)

    def delete(self, step: int) -> None:
        """Delete ``step`` from the bucket, then from the local tier.

        Raises:
            ValueError: ``step`` is queued or in flight for upload (wait for it first).
        """
        with self._cond:
            if step in self._queue or step == self._in_flight:
                raise ValueError(f"step {step} is being uploaded to {self.bucket.url}; wait_uploaded({step}) first")
        self.bucket.delete(step)
        self.local.delete(step)

    # -- the upload thread ---------------------------------------------------------------------
    def _enqueue(self, step: int) -> None:
        with self._cond:
            if self._closed:
                raise ValueError(f"{self!r} is closed")
            self._failed.pop(step, None)
            self._queue.append(step)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"opd-store-upload-{id(self):x}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                step = self._queue.popleft()
                self._in_flight = step
            try:
                callback = self.upload_callback(step) if self.upload_callback is not None else None
                # Retry back-offs of the upload draw from a private generator, not the training
                # thread's Python ``random`` (bit-exact resume; see opd_store.thread_random).
                with route_background_random():
                    url = copy_checkpoint(self.local, step, self.bucket, callback=callback, verify_deep=False)
            except BaseException as exc:  # noqa: BLE001 - recorded and raised at the next save/flush/close
                logger.error("upload of step %d from %s to %s failed: %r", step, self.local.url, self.bucket.url, exc)
                with self._cond:
                    self._failed[step] = exc
                    self._unreported.append((f"upload of step {step}", exc))
                    self._in_flight = None
                    self._cond.notify_all()
                continue
            logger.info("step %d is durable at %s", step, url)
            self._apply_retention()
            with self._cond:
                self._uploaded[step] = url
                self._in_flight = None
                self._cond.notify_all()

    def _local_protected(self) -> frozenset:
        """Local steps that must not be deleted: queued or uploading, failed in this process, or
        absent from the bucket and newer than its newest committed step (not durable yet).

        A local step older than the bucket's newest committed step and absent from the bucket was
        deleted there by the bucket's retention (or superseded after a failed upload in an earlier
        process); :meth:`upload_pending` does not upload such a step either, so protecting it
        would keep it on local disk forever whenever the bucket keeps fewer steps than the local
        tier (a bug the review of ``--keep-last`` found)."""
        in_bucket = set(self.bucket.steps())  # committed there: its manifest exists (one listing)
        newest_durable = max(in_bucket, default=-1)
        with self._cond:
            busy = set(self._queue) | ({self._in_flight} if self._in_flight is not None else set())
            failed = set(self._failed)
        return frozenset(
            step for step in self.local.steps()
            if step in busy or step in failed or (step not in in_bucket and step > newest_durable)
        )

    def _apply_retention(self) -> None:
        for name, hook, tier, protected in (
            ("bucket", self.bucket_retention, self.bucket, lambda: frozenset()),
            ("local", self.local_retention, self.local, self._local_protected),
        ):
            if hook is None:
                continue
            try:
                hook(tier, protected())
            except BaseException as exc:  # noqa: BLE001 - raised at the next save/flush/close
                logger.error("%s retention %r on %s failed: %r", name, hook, tier.url, exc)
                with self._cond:
                    self._unreported.append((f"{name} retention on {tier.url}", exc))


def _close_at_exit(ref: "weakref.ref[TieredStore]") -> None:
    store = ref()
    if store is None or store._thread is None:
        return
    try:
        store.close(store.exit_timeout_secs)
    except Exception as exc:  # noqa: BLE001 - nobody is left to raise to at exit
        logger.error("at exit, %r: %r (the local tier keeps every step not uploaded)", store, exc)


__all__ = ["KeepLastN", "RetentionHook", "TieredStore", "same_payloads"]
