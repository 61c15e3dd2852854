"""``PartTransaction``: one rank's part of a multi-rank save, under the committing rank's attempt.

Created by :meth:`CheckpointStore.begin_part <opd_store.store._checkpoint_store.CheckpointStore.begin_part>`; the
multi-rank stages of the save pipeline (:mod:`opd_store.pipeline._collective`) use it.
"""

from __future__ import annotations

import logging

from ..format import PayloadEntry, object_rel
from ._attempt import Attempt

logger = logging.getLogger("opd_store.commit")


class PartTransaction(Attempt):
    """One rank's part of a multi-rank save: payloads under a shared attempt, never a manifest.

    Created by :meth:`CheckpointStore.begin_part` on every rank but the committing one.
    The payloads stream exactly as in a :class:`~opd_store.commit._transaction.Transaction`; :meth:`seal`
    (a clean ``with`` exit) makes them durable and returns their entries, which the rank sends to
    the committing rank; that rank records them with ``Transaction.add_entry`` and creates the
    manifest. A part has no ``commit``: only the committing rank commits. An exception
    (or :meth:`abort`) deletes only this part's own payloads, never the other ranks'.

    Rank obligations: the committing rank chose ``attempt_id`` (``store.begin``) and shares it;
    payload names must not collide across ranks (``rng-rank-XX.pt`` does not).
    """

    def seal(self) -> tuple[PayloadEntry, ...]:
        """Make this part's payloads durable (local stores fsync) and return their entries.

        A part with no payloads (a DCP rank whose items deduplication gave to other ranks) seals
        without any storage call: its attempt directory may not exist yet, since the committing
        rank and the other parts may not have written anything so far (a local fsync of the
        missing ``step-NNNNNN/`` failed the whole save), and there is nothing to make durable.

        Raises:
            StoragePermissionError, PayloadUploadError: a payload still uploading failed (the
                part's payloads are deleted).
            IncompleteCheckpointError: a payload writer is still open or failed (the part's
                payloads are deleted).
            OSError: the durability sync failed (the part's payloads are deleted).
        """
        self._require_open()
        self._settle_or_abort()
        self._refuse_unclosed(f"rank {self.rank} payloads", "its part is discarded")
        if self._entries:
            try:
                self._sync_payloads()
            except BaseException:
                self.abort()
                raise
        self._state = "sealed"
        self._warn_if_throttled(f"rank {self.rank}'s part")
        return self.entries

    def _discard_payloads(self) -> None:
        # Only this part's own payloads (the base abort calls this): never the other ranks'.
        for entry in self._entries.values():
            try:
                self.storage.delete(object_rel(self.step, entry.prefix, entry.path))
            except Exception:  # noqa: BLE001 - leftovers are harmless; gc removes them
                logger.warning("could not delete payload %s of rank %d at %s", entry.path, self.rank, self.url,
                               exc_info=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.seal()
        else:
            self.abort()


__all__ = ["PartTransaction"]
