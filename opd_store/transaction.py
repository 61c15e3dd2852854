"""One save attempt: stream payloads under a private prefix, then commit the manifest.

The commit protocol (docs/protocol.md):

1. ``begin``: refuse at once if the step already has a manifest or a legacy ``COMPLETE`` marker.
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
from typing import TYPE_CHECKING, Any

from .checksum import Crc32c
from .errors import (
    AmbiguousCommitError,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
    ManifestError,
    OpdStoreError,
    StoragePermissionError,
    UnsupportedBackendError,
)
from .layout import MANIFEST_NAME, check_payload_name, step_dirname
from .manifest import MAX_MANIFEST_BYTES, Manifest, PayloadEntry, Writer, parse_manifest
from .storage.backend_errors import Meaning, backend_operation, classify, is_missing

if TYPE_CHECKING:
    from .storage import Storage

logger = logging.getLogger("opd_store.transaction")


class PayloadWriter:
    """A write-only binary file for one payload; checksums bytes as they stream through.

    ``torch.save(obj, writer)`` streams straight into the backend object: no full serialised copy
    is held in memory (s3fs/gcsfs buffer one upload block, local files write through).

    Use as a context manager: a clean exit publishes the object and records its manifest entry; an
    exception discards it.
    """

    def __init__(self, txn: "Transaction", name: str, rel: str, handle) -> None:
        self._txn = txn
        self.name = name
        self._rel = rel
        self._handle = handle
        self._crc = Crc32c()
        self._state = "open"
        # The first backend error of a write(), raised by close(). torch.save cannot report an
        # exception from write(): its zip writer then fails its own position check while writing
        # the end records and raises "RuntimeError: unexpected pos", hiding the cause (found with
        # a 403 on S3 multipart uploads, issue 5). So write() records the error and drops every
        # later byte; close() discards the object and raises the error; nothing can publish.
        self._write_error: Exception | None = None

    # file protocol ------------------------------------------------------------------------
    def write(self, data) -> int:
        """Write a buffer (``bytes``, ``bytearray`` or ``memoryview``); return its byte count.

        A backend failure (after the backend's own retries) is not raised here but by
        :meth:`close` (or the ``with`` block's exit): ``torch.save`` cannot pass an exception from
        ``write`` through its zip writer (it would report ``RuntimeError: unexpected pos``
        instead). Bytes written after a failure are dropped; the payload is never published.

        Raises:
            ValueError: the writer is closed, aborted or failed.
        """
        if self._state != "open":
            raise ValueError(f"write to a {self._state} payload writer {self.name!r}")
        if self._write_error is not None:
            return memoryview(data).nbytes  # dropped: this payload already failed (see __init__)
        view = data if isinstance(data, memoryview) else memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        count = self._crc.update(view)
        slice_bytes = self._txn.storage.write_slice_bytes  # zero-copy slices (see Storage)
        try:
            for offset in range(0, count, slice_bytes):
                self._handle.write(view[offset:offset + slice_bytes])
        except Exception as exc:  # noqa: BLE001 - raised by close(), see __init__
            # A remote writer uploads as it goes (S3: CreateMultipartUpload, UploadPart).
            self._write_error = exc
            logger.debug("payload %s: write failed (%r); raised at close", self._rel, exc)
        return count

    def _denied(self, exc: BaseException) -> PermissionError:
        if isinstance(exc, OpdStoreError):
            return exc
        operation = backend_operation(exc) or "the write"
        return StoragePermissionError(
            f"{self._txn.storage.url(self._rel)}: permission denied: the backend refused {operation} while "
            f"writing payload {self.name!r} of step {self._txn.step} ({exc}); step {self._txn.step} is not committed"
        )

    def tell(self) -> int:
        return self._crc.size_bytes

    def flush(self) -> None:
        if self._state == "open" and self._write_error is None:
            self._handle.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._state != "open"

    @property
    def size_bytes(self) -> int:
        return self._crc.size_bytes

    def close(self) -> None:
        """Publish the object and record its entry (size_bytes, crc32c) in the transaction.

        Raises:
            StoragePermissionError: the backend refused an upload request, now or during an
                earlier :meth:`write` (S3: the credentials may not ``CreateMultipartUpload`` or
                ``UploadPart``); names the operation (issue 5, scenario 34).
            OSError: any other backend failure, now or during an earlier :meth:`write`; the object
                is discarded (no open multipart upload is left).
        """
        if self._state != "open":
            return
        if self._write_error is not None:
            failed = self._write_error
            self.abort()
            if classify(failed) is Meaning.DENIED and not isinstance(failed, OpdStoreError):
                raise self._denied(failed) from failed
            raise failed
        try:
            self._txn.storage.finish_write(self._handle, self._rel)
        except BaseException as exc:
            self._state = "failed"
            self._txn._writer_failed(self)
            # A failed publish must leave nothing that could publish later or keep costing (an
            # open S3 multipart upload whose completion failed): discard the handle, best effort.
            try:
                self._txn.storage.abort_write(self._handle, self._rel)
            except Exception:  # noqa: BLE001 - the close error is the one to report
                logger.warning("could not discard the failed payload writer %s", self._rel, exc_info=True)
            if classify(exc) is Meaning.DENIED and not isinstance(exc, OpdStoreError):
                raise self._denied(exc) from exc
            raise
        self._state = "closed"
        self._txn._record(
            PayloadEntry(
                name=self.name,
                path=f"{self._txn.attempt_id}/{self.name}",
                size_bytes=self._crc.size_bytes,
                crc32c=self._crc.hexdigest(),
            ),
            self,
        )

    def abort(self) -> None:
        """Discard the object without publishing it."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._txn.storage.abort_write(self._handle, self._rel)
        self._txn._writer_failed(self)

    def __enter__(self) -> "PayloadWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Transaction:
    """A save attempt of one step. Created by :meth:`CheckpointStore.begin`.

    ``with store.begin(step) as txn:`` commits on a clean exit and aborts on an exception (the
    exception propagates; nothing is committed; committed steps are untouched).

    Attributes:
        step (int): the step being saved.
        attempt_id (str): the attempt's prefix name under the step.
        url (str): the checkpoint URL the commit will create (the step prefix).
        metadata (dict): free-form JSON stored in the manifest (trainer counters, fingerprints).
        world_size (int): recorded in the manifest.
        committed_url (str | None): set by a successful commit.
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
        self.storage = storage
        self.step = step
        self.attempt_id = attempt_id
        self.world_size = world_size
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.rank = rank
        self._step_rel = step_dirname(step)
        self.url = storage.url(self._step_rel)
        self._entries: dict[str, PayloadEntry] = {}
        self._open: dict[str, PayloadWriter] = {}
        self._failed: list[str] = []
        self._state = "open"
        self.committed_url: str | None = None

    # payloads -----------------------------------------------------------------------------
    def _payload_rel(self, name: str) -> str:
        return f"{self._step_rel}/{self.attempt_id}/{name}"

    def open(self, name: str) -> PayloadWriter:
        """Open a writer for the payload ``name`` (relative, ``/``-separated).

        Raises:
            ValueError: unsafe name, a name already written or open, or the transaction is over.
        """
        self._require_open()
        check_payload_name(name)
        if name in self._entries or name in self._open:
            raise ValueError(f"payload {name!r} is already part of {self.url} ({self.attempt_id})")
        rel = self._payload_rel(name)
        writer = PayloadWriter(self, name, rel, self.storage.open_write(rel))
        self._open[name] = writer
        return writer

    def write_bytes(self, name: str, data) -> PayloadEntry:
        """Write a whole payload from a buffer and return its entry."""
        with self.open(name) as writer:
            writer.write(data)
        return self._entries[name]

    def add_entry(self, entry: PayloadEntry) -> None:
        """Record a payload written by another process under this attempt (multi-rank saves).

        Raises:
            ValueError: the entry is for another attempt, or its name is already recorded.
        """
        self._require_open()
        if entry.path != f"{self.attempt_id}/{entry.name}":
            raise ValueError(f"payload entry {entry.name!r} belongs to another attempt ({entry.path})")
        if entry.name in self._entries or entry.name in self._open:
            raise ValueError(f"payload {entry.name!r} is already part of {self.url}")
        self._entries[entry.name] = entry

    @property
    def entries(self) -> tuple[PayloadEntry, ...]:
        """Entries of the payloads closed so far, in write order."""
        return tuple(self._entries.values())

    def _record(self, entry: PayloadEntry, writer: PayloadWriter) -> None:
        self._open.pop(writer.name, None)
        self._entries[entry.name] = entry

    def _writer_failed(self, writer: PayloadWriter) -> None:
        self._open.pop(writer.name, None)
        self._failed.append(writer.name)

    def _require_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"transaction for {self.url} ({self.attempt_id}) is {self._state}")

    # commit -------------------------------------------------------------------------------
    def commit(self) -> str:
        """Create the manifest if absent; return the committed checkpoint URL.

        Before the create, one listing of the attempt prefix checks that every payload is stored
        with the size that was written (:meth:`_check_stored_sizes`).

        Raises:
            IncompleteCheckpointError: a payload writer is still open or failed, or a payload is
                missing or of another size on the backend (this attempt's payloads are deleted).
            CommitConflictError: another attempt committed this step first (this attempt's
                payloads are then deleted: no manifest names them).
            UnsupportedBackendError: no create-only write and no opt-in to check-then-put.
            CommitError: the create failed and the read-back found no manifest (payloads kept).
            AmbiguousCommitError: the create and the read-back both failed (payloads kept).
        """
        self._require_open()
        if self._open or self._failed:
            names = sorted(self._open) + sorted(self._failed)
            self.abort()
            raise IncompleteCheckpointError(
                f"{self.url}: payloads {names} were never closed cleanly; nothing was committed"
            )
        self._state = "committing"
        try:
            self.storage.sync_prefix(f"{self._step_rel}/{self.attempt_id}")
            self._check_stored_sizes()
            manifest = Manifest(
                step=self.step,
                attempt_id=self.attempt_id,
                writer=Writer(host=socket.gethostname(), pid=os.getpid(), rank=self.rank),
                created_at=_dt.datetime.now(_dt.timezone.utc),
                world_size=self.world_size,
                payloads=tuple(self._entries.values()),
                metadata=self.metadata,
            )
            data = manifest.to_json_bytes()
        except BaseException:
            # Before the create nothing can name this attempt's payloads: fail like an abort.
            self._state = "failed"
            self._discard_payloads()
            raise
        manifest_rel = f"{self._step_rel}/{MANIFEST_NAME}"
        try:
            self.storage.create_exclusive(manifest_rel, data)
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
        return self.url

    def _check_stored_sizes(self) -> None:
        """Refuse to name a payload whose stored size differs from the bytes written to it.

        A backend (or a proxy, a FUSE mount, a buggy S3-compatible server) can report success for
        a write yet store nothing or a short object (issue 5, scenario 37). Readers would find the
        step incomplete forever, while the save had reported success. One listing of the attempt
        prefix, just before the manifest is created, compares every entry's ``size_bytes`` with
        what the backend holds. Cost: one LIST request per 1,000 payloads on S3/GCS (one in
        practice), a directory walk locally; it also covers payloads other ranks wrote
        (:meth:`Transaction.add_entry`).

        Raises:
            IncompleteCheckpointError: an object is absent or of another size; names each one's
                URL with expected and stored sizes.
        """
        listed = self.storage.list_tree(f"{self._step_rel}/{self.attempt_id}")
        wrong = []
        for entry in self._entries.values():
            stored = listed.get(entry.name)
            if stored != entry.size_bytes:
                where = self.storage.url(self._payload_rel(entry.name))
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

    # abort --------------------------------------------------------------------------------
    def abort(self) -> None:
        """Discard open writers and delete this attempt's payloads. Safe to call twice."""
        if self._state in ("committed", "aborted"):
            return
        for writer in list(self._open.values()):
            writer.abort()
        self._state = "aborted"
        self._discard_payloads()

    def _discard_payloads(self) -> None:
        # Only ever this attempt's own prefix, and only when no manifest names it.
        try:
            self.storage.delete_tree(f"{self._step_rel}/{self.attempt_id}")
        except Exception:  # noqa: BLE001 - leftovers are harmless; gc removes them
            logger.warning("could not delete payloads of aborted attempt %s at %s", self.attempt_id, self.url, exc_info=True)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class PartTransaction(Transaction):
    """One rank's part of a multi-rank save: payloads under a shared attempt, never a manifest.

    Created by :meth:`CheckpointStore.begin_part` on every rank but the committing one (issue 7).
    The payloads stream exactly as in a :class:`Transaction`; :meth:`seal` (a clean ``with`` exit)
    makes them durable and returns their entries, which the rank sends to the committing rank; that
    rank records them with :meth:`Transaction.add_entry` and creates the manifest. An exception
    (or :meth:`abort`) deletes only this part's own payloads, never the other ranks'.

    Rank obligations: the committing rank chose ``attempt_id`` (``store.begin``) and shares it;
    payload names must not collide across ranks (``rng-rank-XX.pt`` does not).
    """

    def commit(self) -> str:  # noqa: D102 - refused: a part never commits
        raise TypeError(
            f"a part transaction of {self.url} ({self.attempt_id}, rank {self.rank}) cannot commit; "
            "seal() it and send the entries to the committing rank"
        )

    def seal(self) -> tuple[PayloadEntry, ...]:
        """Make this part's payloads durable (local stores fsync) and return their entries.

        Raises:
            IncompleteCheckpointError: a payload writer is still open or failed (the part's
                payloads are deleted).
            OSError: the durability sync failed (the part's payloads are deleted).
        """
        self._require_open()
        if self._open or self._failed:
            names = sorted(self._open) + sorted(self._failed)
            self.abort()
            raise IncompleteCheckpointError(
                f"{self.url}: rank {self.rank} payloads {names} were never closed cleanly; its part is discarded"
            )
        try:
            self.storage.sync_prefix(f"{self._step_rel}/{self.attempt_id}")
        except BaseException:
            self.abort()
            raise
        self._state = "sealed"
        return self.entries

    def abort(self) -> None:
        """Discard open writers and delete this part's own payloads. Safe to call twice."""
        if self._state in ("aborted",):
            return
        for writer in list(self._open.values()):
            writer.abort()
        self._state = "aborted"
        self._discard_payloads()

    def _discard_payloads(self) -> None:
        for entry in self._entries.values():
            try:
                self.storage.delete(f"{self._step_rel}/{entry.path}")
            except Exception:  # noqa: BLE001 - leftovers are harmless; gc removes them
                logger.warning("could not delete payload %s of rank %d at %s", entry.path, self.rank, self.url,
                               exc_info=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.seal()
        else:
            self.abort()


__all__ = ["PartTransaction", "PayloadWriter", "Transaction"]
