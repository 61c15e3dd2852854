"""The main job's goodput ledger: what it journals, when it saves, and its final save on a notice.

Events and when each is written: docs/ledger.md ("The run journal", "Saves planned against the
notice", "--checkpoint-every auto"). Only rank 0 writes; every rank joins the collectives at points
where all ranks already meet (start, each save, the notice). Nothing here fails the job: a journal
that cannot be written or read is a warning.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .._version import __version__
from ..ledger import (
    MAX_AUTO_EVERY,
    AutoInterval,
    FinalSavePlan,
    Journal,
    SaveEstimator,
    list_journal,
    parse_event,
    plan_final_save,
    previous_start,
    process_started_secs,
)
from ..opd import decide_on_rank0
from ..runtime import PreemptionNotice
from ..store import BaseStore

logger = logging.getLogger("opd_store.job")
SIGNAL_SOURCES = ("SIGTERM", "SIGINT", "SIGUSR1")


class JobLedger:
    """One start's ledger.

    Args:
        store (BaseStore): the job's store (the journal goes to its durable tier).
        group: the job's ``RankGroup``, or ``None`` for one process.
        updates (int): ``--updates``.
        checkpoint_every (int): the save interval in updates (with ``auto``: the starting one).
        auto (bool): ``--checkpoint-every auto``.
        progress_every_secs (float): seconds between ``progress`` events (0: after every update).
        notice_deadline_secs (float | None): a signal's deadline in seconds (AWS and GCE notices
            carry their own).
        async_save / shard (bool): how the job saves (recorded in ``start``).
        sinks (list): journal sinks (the Prometheus exporter) on rank 0.
        started_secs (float | None): the process start, seconds since the epoch (default: this one's).
    """

    def __init__(self, store: BaseStore, *, group, updates: int, checkpoint_every: int, auto: bool = False,
                 progress_every_secs: float = 60.0, notice_deadline_secs: float | None = None,
                 async_save: bool = False, shard: bool = False, sinks: list | None = None,
                 started_secs: float | None = None) -> None:
        self.group = group
        self.rank, world_size = (group.rank, group.world_size) if group is not None else (0, 1)
        self.store = store
        self.journal = Journal(store if self.rank == 0 else None, world_size=world_size,
                               sinks=(sinks or []) if self.rank == 0 else [])
        self.tally = store.durable_store().storage.requests
        self._tally_at_start = self.tally.snapshot()
        self.updates, self.every, self.auto_mode = updates, checkpoint_every, auto
        self.progress_every_secs = progress_every_secs
        self.notice_deadline_secs = notice_deadline_secs
        self.async_save, self.shard = async_save, shard
        self.process_started_secs = started_secs if started_secs is not None else process_started_secs()
        self.estimator = SaveEstimator()
        self.blocking_secs: list[float] = []
        self.update_secs = 0.0
        self.updates_done = 0
        self.last_committed: int | None = None
        self.next_save_step: int | None = None
        self.auto: AutoInterval | None = None
        self._names: list = []
        self._first_event_secs: float | None = None
        self._first_update = True
        self._last_progress = float("-inf")
        self._other_ranks_requests: dict[str, int] = {}
        self._started_secs = time.time()

    # -- the start -------------------------------------------------------------------------------
    def start(self, resumed_step: int | None) -> None:
        """Journal ``start``; read what the journal says of earlier starts (rank 0, decided for
        every rank); settle the save schedule. A collective with a process group."""
        self.last_committed = resumed_step
        decided = (self._read_journal(resumed_step) if self.group is None
                   else decide_on_rank0(self.group, lambda: self._read_journal(resumed_step)))
        self.every, mtbf, self._first_event_secs, seeds = decided
        for size_bytes, commit_secs, blocking in seeds:
            self.estimator.observe(size_bytes, commit_secs)
            self.blocking_secs.append(blocking)
        if self.auto_mode:
            self.auto = AutoInterval(self.every, mtbf)
            self.next_save_step = (resumed_step or 0) + self.every
            logger.info("--checkpoint-every auto: every %d updates from step %s", self.every, resumed_step or 0)
        self.journal.record("start", process_started_secs=self.process_started_secs, updates=self.updates,
                            checkpoint_every=self.every, checkpoint_every_auto=self.auto_mode,
                            progress_every_secs=self.progress_every_secs, store_url=self.store.url,
                            async_save=self.async_save, shard=self.shard, version=__version__)

    def _read_journal(self, resumed_step: int | None) -> tuple[int, float | None, float | None, list]:
        """(interval, MTBF, first event time, measured saves) from the journal; the user's interval
        and nothing else when it cannot be read, the user's interval when the journaled one is over
        ``MAX_AUTO_EVERY`` (the bound ``AutoInterval`` keeps: only a damaged journal holds more)."""
        every, mtbf, first, seeds = self.every, None, None, []
        try:
            self._names, _strangers = list_journal(self.store)
        except Exception as exc:  # noqa: BLE001 - the journal is never needed
            logger.warning("run journal of %s could not be listed (%s); going on without it", self.store.url, exc)
            return every, mtbf, first, seeds
        if not self._names:
            return every, mtbf, first, seeds
        first = self._names[0].time_secs
        starts = {}
        for name in self._names:
            starts.setdefault(name.start_id, set()).add(name.kind)
        preemptions = sum(1 for kinds in starts.values() if "exit" not in kinds or "notice" in kinds)
        if preemptions:
            mtbf = max(1e-3, time.time() - first) / preemptions
        if resumed_step is not None:
            saved = [n for n in self._names if n.kind == "save" and n.step == resumed_step]
            if saved:
                try:
                    storage = self.store.durable_store().storage
                    event = parse_event(storage.read_bytes(saved[-1].rel, small=True), storage.url(saved[-1].rel))
                    seeds.append((event.size_bytes, event.commit_secs, event.blocking_secs))
                    journaled = event.next_checkpoint_every
                    if self.auto_mode and journaled is not None and journaled > MAX_AUTO_EVERY:
                        logger.warning("run journal: the save event of step %d names an interval of %d updates, "
                                       "over the bound of %d (a damaged journal); ignored: every %d updates",
                                       resumed_step, journaled, MAX_AUTO_EVERY, every)
                    elif self.auto_mode and journaled is not None:
                        every = journaled
                except Exception as exc:  # noqa: BLE001 - a damaged event: the user's interval
                    logger.warning("run journal: the save event of step %d could not be read (%s)", resumed_step, exc)
        return every, mtbf, first, seeds

    def resumed(self, resumed_step: int | None) -> None:
        """Journal ``resume`` (after the state was loaded): the step, and the updates the previous
        start made beyond it (its last step in the journal's names; ``None`` without one)."""
        previous = previous_start(self._names, self.journal.start_id)
        redone = None
        if previous is not None and previous.last_step is not None:
            redone = max(0, previous.last_step - (resumed_step or 0))
        self.journal.record("resume", resumed_step=resumed_step,
                            previous_start_id=previous.start_id if previous is not None else None,
                            updates_redone=redone, checkpoint_every=self.every)

    # -- updates -----------------------------------------------------------------------------------
    def update_done(self, trainer: dict[str, Any], secs: float) -> None:
        """One attempted update took ``secs``; journal ``first_update`` or ``progress`` when due."""
        self.update_secs += secs
        self.updates_done += 1
        common = dict(step=trainer["successful_updates"], attempted_updates=trainer["attempted_updates"],
                      update_secs=self.update_secs)
        now = time.monotonic()
        if self._first_update:
            self._first_update = False
            self._last_progress = now
            self.journal.record("first_update", secs_from_process_start=max(0.0, time.time() - self.process_started_secs),
                                **common)
        elif self.progress_every_secs == 0 or now - self._last_progress >= self.progress_every_secs:
            self._last_progress = now
            self.journal.record("progress", **common)

    def save_due(self, step: int) -> bool:
        """Whether the state at ``step`` (just reached by a successful update) is saved now."""
        if self.auto is None:
            return step % self.every == 0
        return step >= (self.next_save_step or 0)

    # -- saves --------------------------------------------------------------------------------------
    def mark(self) -> tuple[dict[str, int], int]:
        """Where the request count stands (before a save; a journal write still queued is waited
        for, so its request falls outside the save's count)."""
        self.journal.flush()
        return self.tally.snapshot(), self.journal.written + self.journal.failed

    def saved(self, trainer_step: int, record: dict[str, Any], *, mark: tuple[dict[str, int], int],
              blocking_secs: float, attempted_updates: int, reason: str = "periodic") -> None:
        """A save committed (every rank, at the same point): journal ``save`` with its requests
        (every rank's, summed) and, with ``auto``, the next interval (rank 0's, for every rank)."""
        self.journal.flush()  # a journal write in flight is counted once it was sent: settle it first
        requests = self._requests_since(mark)
        if self.group is not None:
            gathered = self.group.all_gather(requests)
            for other in gathered[1:]:
                for kind, count in other.items():
                    self._other_ranks_requests[kind] = self._other_ranks_requests.get(kind, 0) + count
            requests = _summed(gathered)
        commit_secs = float(record["seconds"])
        self.estimator.observe(record.get("size_bytes"), commit_secs)
        self.blocking_secs.append(blocking_secs)
        self.last_committed = max(self.last_committed or 0, trainer_step)
        if self.auto is not None:
            survived = time.time() - (self._first_event_secs or self.process_started_secs)
            mean_update = self.update_secs / self.updates_done if self.updates_done else 0.0
            cost = sum(self.blocking_secs) / len(self.blocking_secs)

            def next_every() -> int:
                return self.auto.after_save(save_cost_secs=cost, update_secs=mean_update, survived_secs=survived)

            every = next_every() if self.group is None else decide_on_rank0(self.group, next_every)
            self.auto.every = every
            if every != self.every:
                logger.warning("--checkpoint-every auto: every %d updates from step %d (was %d)", every,
                               trainer_step, self.every)
            self.every = every
            self.next_save_step = trainer_step + every
        self.journal.record("save", background=True, step=trainer_step, reason=reason,
                            size_bytes=record.get("size_bytes"), blocking_secs=blocking_secs, commit_secs=commit_secs,
                            requests=requests, attempted_updates=attempted_updates, update_secs=self.update_secs,
                            next_checkpoint_every=self.every)

    def save_failed(self) -> None:
        """A save failed (nothing committed): counted by the sinks."""
        for sink in self.journal.sinks:
            failed = getattr(sink, "save_failed", None)
            if failed is not None:
                failed()

    def _requests_since(self, mark: tuple[dict[str, int], int]) -> dict[str, int]:
        before, written = mark
        now = self.tally.snapshot()
        out = {kind: now[kind] - before.get(kind, 0) for kind in now}
        out["put"] -= self.journal.written + self.journal.failed - written  # the journal's own are not the save's
        return {kind: count for kind, count in out.items() if count > 0}

    # -- the notice ------------------------------------------------------------------------------------
    def secs_left(self, notice: PreemptionNotice) -> float | None:
        """Seconds to the notice's deadline: the platform's (AWS, GCE), or ``--notice-deadline-secs``
        after a signal; ``None`` when unknown."""
        left = notice.secs_left()
        if left is None and self.notice_deadline_secs is not None and notice.source in SIGNAL_SOURCES:
            left = self.notice_deadline_secs - (time.monotonic() - notice.received_monotonic)
        return left

    def plan_notice(self, notice: PreemptionNotice, trainer: dict[str, Any], size_bytes: int | None,
                    already_committed: bool) -> FinalSavePlan:
        """Decide the final save (rank 0, for every rank: a collective with a process group) and
        journal ``notice``. ``size_bytes`` is the save's expected size (the last save's)."""
        step = trainer["successful_updates"]

        def decide() -> FinalSavePlan:
            if already_committed:
                return FinalSavePlan("already_committed", None, self.secs_left(notice), "step already committed")
            return plan_final_save(self.estimator.estimate(size_bytes), self.secs_left(notice))

        plan = decide() if self.group is None else decide_on_rank0(self.group, decide)
        lost = step - (self.last_committed or 0) if plan.decision == "skip" else 0
        self.journal.record("notice", source=notice.source, detail=notice.detail[:512], deadline_secs=plan.secs_left,
                            step=step, last_committed_step=self.last_committed, decision=plan.decision,
                            estimate_secs=plan.estimate_secs, updates_lost=max(0, lost), update_secs=self.update_secs)
        return plan

    # -- the end ---------------------------------------------------------------------------------------
    def exit(self, outcome: str, trainer: dict[str, Any], error: BaseException | None = None) -> None:
        """Journal ``exit`` with this start's totals (rank 0's requests, and the other ranks' saves')."""
        now = self.tally.snapshot()
        requests = {kind: now[kind] - self._tally_at_start.get(kind, 0) for kind in now}
        requests["put"] += 1  # this event itself
        requests = _summed([requests, self._other_ranks_requests])
        self.journal.record("exit", outcome=outcome, step=trainer["successful_updates"],
                            attempted_updates=trainer["attempted_updates"], update_secs=self.update_secs,
                            wall_secs=max(0.0, time.time() - self.process_started_secs), requests=requests,
                            error=None if error is None else f"{type(error).__name__}: {error}"[:1024])


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for count in counts:
        for kind, value in count.items():
            out[kind] = out.get(kind, 0) + value
    return {kind: value for kind, value in out.items() if value > 0}


__all__ = ["JobLedger"]
