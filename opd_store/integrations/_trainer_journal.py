"""The goodput ledger's run journal kept from a trainer's hooks: what the Hugging Face callback and
the Lightning callback record (docs/ledger.md, "From other trainers"; the main job's own is
:mod:`opd_store.job._ledger`), with the event schema of :mod:`opd_store.ledger`.

* ``start`` and ``resume`` when training begins, after one listing of the journal: the previous
  start's last step there gives ``updates_redone``, the updates it made after the step resumed;
* ``first_update`` after this start's first update, ``progress`` after an update at most every
  ``progress_every_secs`` (0: every update, so the report's lost updates are exact, not a bound);
* one ``save`` per committed save, written once each of its parts arrived
  (:meth:`TrainerJournal.save_part`: the commit, possibly on a background thread; the seconds the
  training thread was blocked; the other ranks' bytes and requests), from whichever thread brings
  the last part, on the journal's writer thread: the one request the journal adds to a save;
* ``notice`` when the integration sees a preemption notice, ``exit`` when training ends or fails.

Rank 0 writes; the other ranks hold a journal that writes nothing and count only their own save
requests. Nothing here fails or changes training (the seed's resume contract: the journal is never
needed): a listing or write that fails is a warning (:class:`~opd_store.ledger.Journal`), and every
request leaves the caller's random streams alone (:func:`~opd_store.runtime.route_background_random`),
so a run resumes bit-exactly with its journal lost or damaged.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Hashable

from ..ledger import Journal, list_journal, previous_start, process_started_secs
from ..runtime import route_background_random
from ..store import BaseStore

logger = logging.getLogger("opd_store.integrations")

DEFAULT_PROGRESS_EVERY_SECS = 60.0
"""The integrations' ``journal_progress_secs`` default: the job's ``--journal-progress-secs``'s."""


@dataclasses.dataclass(frozen=True)
class RequestMark:
    """Where the store's request count stood when a save began (:meth:`TrainerJournal.mark`).

    Attributes:
        counts (dict[str, int]): requests by kind so far.
        journal_writes (int): journal events written (or failed) so far: their PUTs are not the save's.
        began_monotonic (float): ``time.monotonic()`` when the save began.
    """

    counts: dict[str, int]
    journal_writes: int
    began_monotonic: float


class TrainerJournal:
    """One process start's journal, fed by an integration's hooks (module docstring).

    Args:
        store (BaseStore): the integration's store; the journal goes to its durable tier, and saves'
            requests are counted on that tier (``Storage.requests``).
        rank (int): this process's global rank: only rank 0 writes.
        world_size (int): ranks of the run.
        progress_every_secs (float): seconds between ``progress`` events (0: after every update).
        requests (Callable[[], dict[str, int]] | None): the requests this start's stores sent so far,
            by kind, for the ``exit`` event; default: the durable tier's count.

    Attributes:
        update_secs (float): seconds spent in updates so far (:meth:`update_began` to :meth:`update_done`).
        last_committed_step (int | None): the resumed step, or the newest step saved since.
    """

    def __init__(self, store: BaseStore, *, rank: int, world_size: int, progress_every_secs: float,
                 requests: Callable[[], dict[str, int]] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.journal = Journal(store if rank == 0 else None, world_size=world_size)
        self.progress_every_secs = progress_every_secs
        self._tally = store.durable_store().storage.requests
        self._requests = requests or self._tally.snapshot
        self._requests_at_start = self._requests()
        self._other_ranks_requests: dict[str, int] = {}
        self._process_started_secs = process_started_secs()
        self._lock = threading.RLock()  # one event at a time: saves may complete on other threads
        self._pending: dict[Hashable, dict[str, dict[str, Any]]] = {}
        self._update_began: float | None = None
        self._last_progress = float("-inf")
        self._first_update = True
        self.update_secs = 0.0
        self.last_committed_step: int | None = None

    # -- the start ---------------------------------------------------------------------------------
    def started(self, resumed_step: int | None, **start_fields: Any) -> None:
        """Journal ``start`` (with ``start_fields``: ``updates``, ``checkpoint_every``, ``async_save``...)
        and ``resume``: the step resumed from (``None``: from scratch) and the updates the previous
        start made after it (from one listing of the journal; ``None`` when it cannot be listed)."""
        self.last_committed_step = resumed_step
        if self.rank != 0:
            return
        names: list = []
        try:
            with route_background_random():
                names, _strangers = list_journal(self.store)
        except Exception as exc:  # noqa: BLE001 - the journal is never needed
            logger.warning("run journal of %s could not be listed (%s); going on without it", self.store.url, exc)
        previous = previous_start(names, self.journal.start_id)
        redone = None
        if previous is not None and previous.last_step is not None:
            redone = max(0, previous.last_step - (resumed_step or 0))
        with self._lock:
            self.journal.record("start", process_started_secs=self._process_started_secs,
                                store_url=self.store.url, progress_every_secs=self.progress_every_secs, **start_fields)
            self.journal.record("resume", resumed_step=resumed_step,
                                previous_start_id=previous.start_id if previous is not None else None,
                                updates_redone=redone)

    # -- updates -----------------------------------------------------------------------------------
    def update_began(self) -> None:
        """An update starts now (the training thread)."""
        self._update_began = time.monotonic()

    def update_done(self, step: int) -> None:
        """The update begun last ended at ``step`` (the trainer's count of optimizer updates);
        journal ``first_update`` or ``progress`` when due, before the next update starts."""
        now = time.monotonic()
        if self._update_began is not None:
            self.update_secs += now - self._update_began
            self._update_began = None
        common = dict(step=step, attempted_updates=step, update_secs=self.update_secs)
        with self._lock:
            if self._first_update:
                self._first_update = False
                self._last_progress = now
                self.journal.record("first_update", **common,
                                    secs_from_process_start=max(0.0, time.time() - self._process_started_secs))
            elif self.progress_every_secs == 0 or now - self._last_progress >= self.progress_every_secs:
                self._last_progress = now
                self.journal.record("progress", **common)

    # -- saves -------------------------------------------------------------------------------------
    def mark(self) -> RequestMark:
        """Where the request count stands before a save (a journal event still queued is written
        first, so its request falls outside the save's)."""
        with self._lock:
            self.journal.flush()
            return RequestMark(self._tally.snapshot(), self._writes(), time.monotonic())

    def requests_since(self, mark: RequestMark) -> dict[str, int]:
        """Requests of the durable tier since ``mark``, by kind, less the journal's own PUTs."""
        with self._lock:
            self.journal.flush()
            now = self._tally.snapshot()
            out = {kind: now[kind] - mark.counts.get(kind, 0) for kind in now}
            out["put"] = out.get("put", 0) - (self._writes() - mark.journal_writes)
            return _summed(out)

    def save_part(self, key: Hashable, part: str, parts: tuple[str, ...], *, failed: bool = False,
                  requests: dict[str, int] | None = None, other_ranks_requests: dict[str, int] | None = None,
                  size_bytes: int | None = None, **fields: Any) -> None:
        """One part of the save ``key`` (any thread); once every part named in ``parts`` arrived,
        journal its ``save`` event.

        Args:
            key: the save (its step; a name and a sequence number for Lightning).
            part (str): which part this is (one of ``parts``).
            parts (tuple[str, ...]): the parts the event waits for.
            failed (bool): the save failed (nothing committed): it is dropped, unjournaled.
            requests (dict[str, int] | None): requests of this part, by kind (summed over the parts).
            other_ranks_requests (dict[str, int] | None): the other ranks' requests: the event's and
                the ``exit`` event's.
            size_bytes (int | None): bytes of this part (summed over the parts).
            **fields: the other fields of :class:`~opd_store.ledger.SaveEvent` (``step``,
                ``reason``, ``blocking_secs``, ``commit_secs``), each from one part.
        """
        with self._lock:
            if other_ranks_requests:
                _add(self._other_ranks_requests, other_ranks_requests)
            entry = self._pending.setdefault(key, {})
            entry[part] = dict(fields, failed=failed, requests=_summed(requests or {}, other_ranks_requests or {}),
                               size_bytes=size_bytes)
            if not set(parts) <= set(entry):
                return
            del self._pending[key]
            if any(p["failed"] for p in entry.values()):
                return
            merged: dict[str, Any] = {}
            for p in entry.values():
                merged.update({name: value for name, value in p.items()
                               if name not in ("failed", "requests", "size_bytes") and value is not None})
            sizes = [p["size_bytes"] for p in entry.values() if p["size_bytes"] is not None]
            merged["size_bytes"] = sum(sizes) if sizes else None
            merged["requests"] = _summed(*(p["requests"] for p in entry.values()))
            merged.setdefault("update_secs", self.update_secs)
            merged.setdefault("attempted_updates", merged["step"])
            self.last_committed_step = max(self.last_committed_step or 0, merged["step"])
            self.journal.record("save", background=True, **merged)

    # -- the notice and the end --------------------------------------------------------------------
    def notice(self, *, source: str, detail: str, step: int, decision: str, deadline_secs: float | None) -> None:
        """Journal a preemption notice the trainer saw at ``step`` and what was done
        (``save``, ``skip`` or ``already_committed``; a skip loses the updates since the last commit)."""
        lost = step - (self.last_committed_step or 0) if decision == "skip" else 0
        with self._lock:
            self.journal.record("notice", source=source[:64], detail=detail[:512], deadline_secs=deadline_secs,
                                step=step, last_committed_step=self.last_committed_step, decision=decision,
                                updates_lost=max(0, lost), update_secs=self.update_secs)

    def exit(self, outcome: str, step: int, error: BaseException | None = None) -> None:
        """Journal ``exit`` (``finished``, ``preempted`` or ``failed``) with this start's requests
        (this process's stores', this event's own PUT, the other ranks' saves')."""
        with self._lock:
            self.journal.flush()  # a save event still queued: its PUT is this start's
            now = self._requests()
            requests = {kind: now[kind] - self._requests_at_start.get(kind, 0) for kind in now}
            requests["put"] = requests.get("put", 0) + (1 if self.rank == 0 else 0)
            self.journal.record("exit", outcome=outcome, step=step, attempted_updates=step,
                                update_secs=self.update_secs,
                                wall_secs=max(0.0, time.time() - self._process_started_secs),
                                requests=_summed(requests, self._other_ranks_requests),
                                error=None if error is None else f"{type(error).__name__}: {error}"[:1024])
            self.journal.flush()

    def _writes(self) -> int:
        return self.journal.written + self.journal.failed


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for kind, count in counts.items():
        into[kind] = into.get(kind, 0) + count


def _summed(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for count in counts:
        _add(out, count)
    return {kind: value for kind, value in out.items() if value > 0}


__all__ = ["DEFAULT_PROGRESS_EVERY_SECS", "RequestMark", "TrainerJournal"]
