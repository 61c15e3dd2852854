"""One save attempt: stream payloads under a private prefix, then commit the manifest.

The commit protocol (docs/protocol.md):

1. ``begin`` (the store's): refuse at once if the step already has a manifest or holds a legacy
   checkpoint.
2. Payloads stream into ``step-NNNNNN/<attempt_id>/<name>``; size and CRC32C are computed on the
   bytes as they pass, never in a second pass.
3. Local stores fsync every payload and directory.
4. The manifest (every payload's name, size and checksum) is created only if absent. That create
   is the commit point: before it the step does not exist, after it the step is complete.
5. A failed or ambiguous create is read back: the manifest carries the attempt id, so a create that
   landed although its response was lost (or was retried into a 412) is recognised as ours.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Callable

from ..errors import (
    AmbiguousCommitError,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
    ManifestError,
    UnsupportedBackendError,
)
from ..format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, PayloadEntry, Writer, object_rel, parse_manifest
from ..runtime import kill_points
from ..storage import Meaning, classify, is_missing
from ._attempt import Attempt
from ._payload_writer import PayloadWriter

if TYPE_CHECKING:
    from ..storage import Storage

logger = logging.getLogger("opd_store.commit")


class Transaction(Attempt):
    """A save attempt of one step that commits with a manifest. Created by :meth:`CheckpointStore.begin`.

    ``with store.begin(step) as txn:`` commits on a clean exit and aborts on an exception (the
    exception propagates; nothing is committed; committed steps are untouched).

    Attributes:
        step (int): the step being saved.
        attempt_id (str): the attempt's prefix name under the step.
        url (str): the checkpoint URL the commit will create (the step prefix).
        metadata (dict): free-form JSON stored in the manifest (trainer counters, fingerprints).
        world_size (int): recorded in the manifest.
        committed_url (str | None): set by a successful commit.
        committed_manifest (Manifest | None): the manifest a successful commit created.
    """

    def __init__(
        self,
        storage: "Storage",
        step: int,
        attempt_id: str,
        *,
        world_size: int = 1,
        metadata: dict[str, Any] | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__(storage, step, attempt_id, world_size=world_size, rank=rank)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._before_commit: list[Callable[[], None]] = []
        self._after_commit: list[Callable[[str], None]] = []
        self.committed_url: str | None = None
        self.committed_manifest: Manifest | None = None

    def on_commit(self, *, before: Callable[[], None] | None = None,
                  after: Callable[[str], None] | None = None) -> None:
        """Register work around the commit (a tiered store's bucket check and upload).

        Args:
            before (Callable[[], None] | None): runs after the last payload, before the manifest
                create; an exception it raises aborts the attempt (payloads deleted) and
                propagates from :meth:`commit`.
            after (Callable[[str], None] | None): runs with the committed URL once the manifest
                landed; an exception it raises propagates from :meth:`commit` (the step stays
                committed).
        """
        if before is not None:
            self._before_commit.append(before)
        if after is not None:
            self._after_commit.append(after)

    def add_entry(self, entry: PayloadEntry) -> None:
        """Record a payload written by another process under this attempt (multi-rank saves).

        Raises:
            ValueError: the entry is for another attempt, lies under a prefix this store's layout
                does not allow (a rank that opened the store with another ``key_layout``), or its
                name is already recorded.
        """
        self._require_open()
        if entry.path != f"{self.attempt_id}/{entry.name}":
            raise ValueError(f"payload entry {entry.name!r} belongs to another attempt ({entry.path})")
        if not self.layout.allows(entry.prefix):
            raise ValueError(f"payload entry {entry.name!r} lies under prefix {entry.prefix!r}, which the "
                             f"{self.layout.strategy} layout of {self.url} does not allow: every rank must open the "
                             "store with the same key_layout and key_prefixes")
        if entry.name in self._entries or entry.name in self._open:
            raise ValueError(f"payload {entry.name!r} is already part of {self.url}")
        self._entries[entry.name] = entry

    # commit -------------------------------------------------------------------------------
    def commit(self) -> str:
        """Create the manifest if absent; return the committed checkpoint URL.

        Before the create, one listing of the attempt prefix checks that every payload is stored
        with the size that was written (:meth:`_check_stored_sizes`).

        Raises:
            StoragePermissionError, PayloadUploadError: a payload still uploading in the background
                failed (this attempt's payloads are deleted).
            IncompleteCheckpointError: a payload writer is still open or failed, or a payload is
                missing or of another size on the backend (this attempt's payloads are deleted).
            CommitConflictError: another attempt committed this step first (this attempt's
                payloads are then deleted: no manifest names them).
            UnsupportedBackendError: no create-only write and no opt-in to check-then-put.
            CommitError: the create failed and the read-back found no manifest (payloads kept).
            AmbiguousCommitError: the create and the read-back both failed (payloads kept).
            SaveAbandonedError: the attempt was cancelled (:meth:`cancel_when`); payloads deleted.
            Whatever a ``before`` hook of :meth:`on_commit` raises (payloads deleted), or an
            ``after`` hook raises (committed).
        """
        self._require_open()
        self._check_cancelled()
        self._settle_or_abort()
        for check in self._before_commit:
            try:
                check()
            except BaseException:
                self.abort()
                raise
        self._refuse_unclosed("payloads", "nothing was committed")
        self._state = "committing"
        try:
            self._sync_payloads()
            self._check_stored_sizes()
            manifest = Manifest(
                step=self.step,
                attempt_id=self.attempt_id,
                writer=Writer(host=socket.gethostname(), pid=os.getpid(), rank=self.rank),
                created_at=_dt.datetime.now(_dt.timezone.utc),
                world_size=self.world_size,
                payloads=tuple(self._entries.values()),
                metadata=self.metadata,
                layout=self.layout,
            )
            data = manifest.to_json_bytes()
        except BaseException:
            # Before the create nothing can name this attempt's payloads: fail like an abort.
            self._state = "failed"
            self._discard_payloads()
            raise
        manifest_rel = f"{self._step_rel}/{MANIFEST_NAME}"
        kill_points.reach("before_manifest", step=self.step)  # test-only (the soak); nothing when not armed
        try:
            self.storage.create_exclusive(manifest_rel, data)
            kill_points.reach("after_commit", step=self.step)
        except UnsupportedBackendError:
            self._state = "failed"
            self._discard_payloads()
            raise
        except Exception as exc:  # noqa: BLE001 - decided by the table of backend failures, then read back
            # A refused create-only write (S3 412/409, GCS 412, EEXIST) is a lost race; any other
            # failure may or may not have landed (a lost response, a retry into a 412).
            self._settle(manifest_rel, exc, lost_race=classify(exc) is Meaning.LOST_RACE)
        self._state = "committed"
        self.committed_url = self.url
        self.committed_manifest = manifest
        self._warn_if_throttled("the save")
        for hook in self._after_commit:
            hook(self.url)
        return self.url

    def _check_stored_sizes(self) -> None:
        """Refuse to name a payload whose stored size differs from the bytes written to it.

        A backend (or a proxy, a FUSE mount, a buggy S3-compatible server) can report success for
        a write yet store nothing or a short object. Readers would find the
        step incomplete forever, while the save had reported success. One listing of the attempt
        prefix, just before the manifest is created, compares every entry's ``size_bytes`` with
        what the backend holds. Cost: one LIST request per 1,000 payloads on S3/GCS (one in
        practice; in the spread layout one per prefix used), a directory walk locally; it also
        covers payloads other ranks wrote (:meth:`Transaction.add_entry`).

        Raises:
            IncompleteCheckpointError: an object is absent or of another size; names each one's
                URL with expected and stored sizes.
        """
        listed = {prefix: self.storage.list_tree(self._attempt_rel(prefix)) for prefix in self._used_prefixes()}
        wrong = []
        for entry in self._entries.values():
            stored = listed[entry.prefix].get(entry.name)
            if stored != entry.size_bytes:
                where = self.storage.url(object_rel(self.step, entry.prefix, entry.path))
                wrong.append(f"{where}: wrote {entry.size_bytes} bytes, backend holds "
                             + ("no object" if stored is None else f"{stored} bytes"))
        if wrong:
            raise IncompleteCheckpointError(
                f"{self.url}: step {self.step} not committed, the backend did not store what was written: "
                + "; ".join(wrong)
            )

    def _settle(self, manifest_rel: str, exc: BaseException, *, lost_race: bool) -> None:
        """Decide a failed create by reading the manifest back and comparing attempt ids."""
        url = self.storage.url(manifest_rel)
        try:
            found = parse_manifest(
                self.storage.read_bytes(manifest_rel, small=True, max_bytes=MAX_MANIFEST_BYTES), url=url, expected_step=self.step
            )
        except ManifestError as bad:
            # Whatever that object is, it does not name this attempt's payloads.
            self._state = "failed"
            self._discard_payloads()
            raise CommitConflictError(
                f"{self.url}: step {self.step} already holds an unreadable manifest ({bad}); "
                f"attempt {self.attempt_id} was not committed"
            ) from exc
        except Exception as read_exc:  # noqa: BLE001 - no manifest is an answer; anything else is not
            if is_missing(read_exc):
                found = None
            else:
                self._state = "failed"
                raise AmbiguousCommitError(
                    f"{self.url}: the manifest create for attempt {self.attempt_id} failed ({exc!r}) and "
                    f"reading it back failed too ({read_exc!r}); the step may or may not be committed"
                ) from exc
        if found is not None and found.attempt_id == self.attempt_id:
            logger.warning("commit of %s reported %r but the manifest of attempt %s landed", self.url, exc, self.attempt_id)
            return
        self._state = "failed"
        if found is not None:
            self._discard_payloads()
            raise CommitConflictError(
                f"{self.url}: step {self.step} was committed by attempt {found.attempt_id} "
                f"({found.writer.host} pid {found.writer.pid}); attempt {self.attempt_id} lost"
            ) from exc
        if lost_race:
            # Create refused, yet no manifest: it was deleted in between. Nothing of ours landed.
            self._discard_payloads()
            raise CommitConflictError(
                f"{self.url}: the manifest create of step {self.step} was refused but no manifest is there now"
            ) from exc
        raise CommitError(
            f"{self.url}: the manifest create for attempt {self.attempt_id} failed ({exc!r}); "
            f"no manifest is there, so step {self.step} is not committed"
        ) from exc

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


__all__ = ["PayloadWriter", "Transaction"]  # PayloadWriter: from opd_store.commit._payload_writer
