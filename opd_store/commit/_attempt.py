"""``Attempt``: the payloads of one save attempt, streamed under the attempt's private prefix.

Every payload of a save goes to ``step-NNNNNN/<attempt_id>/<name>`` (or, in the spread layout, to
``.spread/XX/step-NNNNNN/<attempt_id>/<name>``: :mod:`opd_store.format._layout`, the store's
``storage.layout``) through a :class:`~opd_store.commit._payload_writer.PayloadWriter`, which records
its size and CRC32C. An attempt that spent more than ``throttle_warn_share`` of its time throttled
by the store (:mod:`opd_store.storage.transfers._pacing`) logs a warning when it commits or seals,
naming the share, the throttled answers and the retries. Two kinds of attempt build on this: a :class:`~opd_store.commit._transaction.Transaction` commits the attempt with a
manifest; a :class:`~opd_store.commit._part_transaction.PartTransaction` (one rank of a multi-rank save)
seals its part and hands the entries to the committing rank.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import IncompleteCheckpointError, SaveAbandonedError
from ..format import PayloadEntry, check_payload_name, object_rel, step_dirname, step_rel
from ._payload_writer import PayloadWriter

if TYPE_CHECKING:
    from ..storage import Storage
    from ..storage.transfers import Completion

logger = logging.getLogger("opd_store.commit")


class Attempt:
    """The payloads of one save attempt of ``step``.

    Attributes:
        storage (Storage): the store's storage.
        step (int): the step being saved.
        attempt_id (str): the attempt's prefix name under the step.
        url (str): the checkpoint URL (the step prefix).
        world_size (int): ranks writing the checkpoint.
        rank (int): the writing rank.
        layout (KeyLayout): where its payloads go (the storage's layout).
    """

    def __init__(self, storage: "Storage", step: int, attempt_id: str, *, world_size: int = 1, rank: int = 0) -> None:
        self.storage = storage
        self.step = step
        self.attempt_id = attempt_id
        self.world_size = world_size
        self.rank = rank
        self.layout = storage.layout
        self._started_secs = time.monotonic()
        self._pacer_at_start = storage.transfers.pacer.stats()
        self._step_rel = step_dirname(step)
        self.url = storage.url(self._step_rel)
        self._entries: dict[str, PayloadEntry] = {}
        self._open: dict[str, PayloadWriter] = {}
        self._publishing: dict[str, tuple[PayloadWriter, "Completion"]] = {}
        self._failed: list[str] = []
        self._state = "open"
        self._cancelled: threading.Event | None = None

    def cancel_when(self, event: threading.Event) -> None:
        """Abandon this attempt once ``event`` is set: later payload writes fail without I/O and a
        commit refuses with :class:`~opd_store.errors.SaveAbandonedError` (the background worker's
        exit deadline). Set it before opening payloads."""
        self._cancelled = event

    def _check_cancelled(self) -> None:
        if self._cancelled is not None and self._cancelled.is_set():
            self.abort()
            raise SaveAbandonedError(
                f"{self.url}: the save of step {self.step} (attempt {self.attempt_id}) was abandoned before its "
                "commit (exit deadline passed); the step stays uncommitted"
            )

    # payloads -----------------------------------------------------------------------------
    def _attempt_rel(self, prefix: str | None) -> str:
        """This attempt's prefix under ``prefix`` (``None``: the step prefix itself)."""
        return f"{step_rel(self.step, prefix)}/{self.attempt_id}"

    def _attempt_rels(self) -> list[str]:
        """Every prefix where this attempt may hold objects: under the step and, in the spread
        layout, under each of the layout's prefixes."""
        return [self._attempt_rel(prefix) for prefix in (None, *self.layout.prefix_names())]

    def _used_prefixes(self) -> list[str | None]:
        """The prefixes the recorded entries lie under, each once (the step prefix when none)."""
        return list(dict.fromkeys(entry.prefix for entry in self._entries.values())) or [None]

    def open(self, name: str) -> PayloadWriter:
        """Open a writer for the payload ``name`` (relative, ``/``-separated).

        Raises:
            ValueError: unsafe name, a name already written or open, or the attempt is over.
        """
        self._require_open()
        check_payload_name(name)
        if name in self._entries or name in self._open or name in self._publishing:
            raise ValueError(f"payload {name!r} is already part of {self.url} ({self.attempt_id})")
        prefix = self.layout.prefix_for(self.rank, name)
        path = f"{self.attempt_id}/{name}"
        rel = object_rel(self.step, prefix, path)
        writer = PayloadWriter(self.storage, name, rel, path, self.step,
                               self.storage.open_write(rel), on_closed=self._record, on_failed=self._writer_failed,
                               cancelled=self._cancelled, on_publishing=self._writer_publishing, prefix=prefix)
        self._open[name] = writer
        return writer

    def write_bytes(self, name: str, data) -> PayloadEntry:
        """Write a whole payload from a buffer and return its entry (its publish may still be
        finishing in the background; :meth:`settle` waits)."""
        with self.open(name) as writer:
            writer.write(data)
        return self._entries[name]

    @property
    def entries(self) -> tuple[PayloadEntry, ...]:
        """Entries of the payloads published so far, in the order they were closed."""
        return tuple(e for name, e in self._entries.items() if name not in self._publishing)

    def _record(self, entry: PayloadEntry) -> None:
        self._open.pop(entry.name, None)
        self._publishing.pop(entry.name, None)
        self._entries[entry.name] = entry

    def _writer_failed(self, name: str) -> None:
        self._open.pop(name, None)
        self._publishing.pop(name, None)
        self._entries.pop(name, None)
        self._failed.append(name)

    def _writer_publishing(self, writer: PayloadWriter, completion: "Completion") -> None:
        # The entry takes its place in close order now (the manifest lists payloads in that order);
        # it counts once settled.
        self._open.pop(writer.name, None)
        self._publishing[writer.name] = (writer, completion)
        self._entries[writer.name] = writer.entry()

    def settle(self) -> None:
        """Wait for every payload still publishing in the background; record their entries.

        Payloads of one save upload at once: a closed payload's last parts keep moving while the
        next one streams. The commit (and a part's seal) settles them first.

        Raises:
            StoragePermissionError, PayloadUploadError: the first payload whose upload failed
                (named with its step); every other one was waited for first.
        """
        first: BaseException | None = None
        for writer, completion in list(self._publishing.values()):
            try:
                writer.settle(completion)
            except BaseException as exc:  # noqa: BLE001 - the first is raised once all settled
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def _require_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"transaction for {self.url} ({self.attempt_id}) is {self._state}")

    def _settle_or_abort(self) -> None:
        """Wait for the payloads still publishing; abort the attempt if one failed.

        Raises:
            StoragePermissionError, PayloadUploadError: a payload's upload failed (the attempt's
                payloads are deleted).
        """
        try:
            self.settle()  # payloads still uploading in the background
        except BaseException:
            self.abort()
            raise

    def _refuse_unclosed(self, subject: str, outcome: str) -> None:
        """Abort the attempt if a payload writer is still open or failed: a payload that was never
        closed cleanly must not be committed or sealed (its bytes may be partial).

        Args:
            subject (str): whose payloads, as the message says it (``"payloads"``, ``"rank 1 payloads"``).
            outcome (str): what the refusal means for the save (the end of the error's message).

        Raises:
            IncompleteCheckpointError: naming the payloads (the attempt's payloads are deleted).
        """
        if self._open or self._failed:
            names = sorted(self._open) + sorted(self._failed)
            self.abort()
            raise IncompleteCheckpointError(f"{self.url}: {subject} {names} were never closed cleanly; {outcome}")

    # abort --------------------------------------------------------------------------------
    def abort(self) -> None:
        """Discard open writers and delete this attempt's payloads. Safe to call twice."""
        if self._state in ("committed", "aborted"):
            return
        for writer in list(self._open.values()):
            writer.abort()
        try:
            self.settle()  # what is still uploading lands or fails; then the prefix is deleted
        except Exception:  # noqa: BLE001 - the abort's cause is the error to report
            logger.debug("a payload of aborted attempt %s failed to publish", self.attempt_id, exc_info=True)
        self._state = "aborted"
        self._discard_payloads()

    def _discard_payloads(self) -> None:
        # Only ever this attempt's own prefixes, and only when no manifest names them.
        try:
            for rel in self._attempt_rels():
                self.storage.delete_tree(rel)
        except Exception:  # noqa: BLE001 - leftovers are harmless; gc removes them
            logger.warning("could not delete payloads of aborted attempt %s at %s", self.attempt_id, self.url, exc_info=True)

    def _sync_payloads(self) -> None:
        """Make the recorded payloads durable (local stores fsync each attempt directory used)."""
        for prefix in self._used_prefixes():
            self.storage.sync_prefix(self._attempt_rel(prefix))

    # throttling ---------------------------------------------------------------------------
    def throttled_share(self) -> tuple[float, int, int]:
        """``(share of this attempt's time so far spent throttled, throttled answers, retries)``
        by the store's pacer (:mod:`opd_store.storage.transfers._pacing`)."""
        now, start = self.storage.transfers.pacer.stats(), self._pacer_at_start
        elapsed = max(time.monotonic() - self._started_secs, 1e-9)
        return (min(1.0, (now.throttled_secs - start.throttled_secs) / elapsed),
                now.throttled_answers - start.throttled_answers, now.retries - start.retries)

    def _warn_if_throttled(self, what: str) -> None:
        """Log a warning when more than ``throttle_warn_share`` of this attempt's time was
        throttled (``what``: the attempt's role, as the message says it)."""
        share, answers, retries = self.throttled_share()
        limit = self.storage.transfers.settings.throttle_warn_share
        if answers and share > limit:
            logger.warning(
                "%s of step %d at %s spent %.0f%% of its time throttled by the store (%d throttled answers, %d "
                "retries; warning above %.0f%%, storage option throttle_warn_share): spread its keys "
                "(key_layout=spread) or lower parts_in_flight (docs/protocol.md, \"Key layouts\")",
                what, self.step, self.url, 100 * share, answers, retries, 100 * limit)

    def __enter__(self):
        return self


__all__ = ["Attempt"]
