"""The main job's checkpoints: every save goes through the one save pipeline, on any store.

:class:`JobSaves` is what the training loop calls to checkpoint. Periodic saves run the pipeline
on the training thread (:func:`~opd_store.opd._save.save_opd_checkpoint`) or, with ``async_save``,
on the background worker (:class:`~opd_store.opd._async_save.AsyncCheckpointer`); the save on a
preemption notice runs it on the training thread after the background one finished. Which store
it is (plain or tiered) is the pipeline's business, not the job's. Every ``saved`` event is
emitted from the training thread, in step order.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, TextIO

from ..errors import CheckpointNotFoundError
from ..opd import AsyncCheckpointer, SaveHandle, save_opd_checkpoint
from ..runtime import PreemptionNotice
from ..store import BaseStore


def emit(stream: TextIO, record: dict[str, Any]) -> None:
    """One JSON line on ``stream``, flushed (the demo reads events while the job runs)."""
    stream.write(json.dumps(record) + "\n")
    stream.flush()


class JobSaves:
    """The job's checkpoints (see the module docstring).

    Args:
        store (BaseStore): where checkpoints go.
        events (TextIO): the job's event stream.
        save_kwargs (dict): the arguments every save shares (store, model, optimizer, ...,
            ``retention``, ``lineage``).
        async_save (bool): periodic saves on the background worker.
        save (Callable): the synchronous save, called with ``trainer_state``, ``teacher_state``
            and ``save_kwargs`` (:func:`~opd_store.opd._save.save_opd_checkpoint`, or
            :func:`~opd_store.opd._sharded.save_sharded_opd_checkpoint` for a sharded student).
        ledger (JobLedger | None): journals each committed save and plans the final save on a
            notice (:mod:`opd_store.job._ledger`).

    Attributes:
        saves (list[dict]): one record per committed save (``step``, ``url``, ``seconds``,
            ``size_bytes``; ``blocked_seconds`` for asynchronous ones).
    """

    def __init__(self, store: BaseStore, events: TextIO, save_kwargs: dict[str, Any], *, async_save: bool,
                 save: Callable[..., str] = save_opd_checkpoint, ledger=None) -> None:
        self.store = store
        self.ledger = ledger
        self.save = save
        self.events = events
        self.save_kwargs = save_kwargs
        self.checkpointer = AsyncCheckpointer() if async_save else None
        self.saves: list[dict[str, Any]] = []
        self._pending: list[tuple[SaveHandle, float, Any]] = []  # the async save in flight, when it began, ledger mark

    def periodic(self, trainer: dict[str, Any], teacher_state: dict[str, Any]) -> None:
        """Checkpoint the state after a successful update (``save_begin``, then ``saved`` now or,
        asynchronously, ``save_snapshot`` now and ``saved`` once committed)."""
        step = trainer["successful_updates"]
        emit(self.events, {"event": "save_begin", "step": step})
        if self.checkpointer is None:
            self.save_now(trainer, teacher_state)
            return
        started = time.perf_counter()
        mark = self.ledger.mark() if self.ledger is not None else None
        handle = self.checkpointer.save(trainer_state=dict(trainer), teacher_state=teacher_state, **self.save_kwargs)
        emit(self.events, {"event": "save_snapshot", "step": step, "blocked_seconds": handle.blocked_secs})
        self._pending.append((handle, started, (mark, trainer["attempted_updates"])))

    def save_now(self, trainer: dict[str, Any], teacher_state: dict[str, Any], *,
                 reason: str = "periodic") -> dict[str, Any]:
        """A synchronous save of the current state; records and emits ``saved`` (and journals it,
        ``reason`` ``periodic`` or ``notice``)."""
        step = trainer["successful_updates"]
        started = time.perf_counter()
        mark = self.ledger.mark() if self.ledger is not None else None
        url = self._counting_failure(lambda: self.save(trainer_state=dict(trainer), teacher_state=teacher_state,
                                                       **self.save_kwargs))
        record = self._record(step, url, time.perf_counter() - started)
        emit(self.events, {"event": "saved", **record})
        if self.ledger is not None:
            self.ledger.saved(step, record, mark=mark, blocking_secs=record["seconds"],
                              attempted_updates=trainer["attempted_updates"], reason=reason)
        return record

    def report_finished(self) -> None:
        """Record the asynchronous save once it committed (raises its failure: never only logged)."""
        while self._pending and self._pending[0][0].done():
            handle, started, (mark, attempted) = self._pending.pop(0)
            url = self._counting_failure(handle.result)
            record = self._record(handle.step, url, time.perf_counter() - started)
            record["blocked_seconds"] = handle.blocked_secs
            emit(self.events, {"event": "saved", **record})
            if self.ledger is not None:
                self.ledger.saved(handle.step, record, mark=mark, blocking_secs=handle.blocked_secs,
                                  attempted_updates=attempted)

    def finish(self) -> None:
        """Wait for the asynchronous save in flight and report it (raises its failure)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.report_finished()

    def close(self) -> None:
        """Stop the background worker (after :meth:`finish`, or when the job is failing)."""
        if self.checkpointer is not None:
            self.checkpointer.close()

    def on_notice(self, notice: PreemptionNotice, trainer: dict[str, Any],
                  teacher_state: dict[str, Any]) -> dict[str, Any]:
        """The preemption path: the update in progress has finished; wait for an asynchronous save
        in flight, then save the current state on this thread (unless its step is already
        committed: that checkpoint is this state's, or one the run replays exactly; or the ledger's
        plan says it cannot commit before the notice's deadline: ``action`` ``skipped`` with
        ``reason``, ``last_committed_step`` and ``updates_lost``) and return the ``preempted``
        event, emitted. Several ranks: every rank calls it at the same boundary (the
        notice was agreed) and the save is the multi-rank save, committed once."""
        started = time.perf_counter()
        try:
            self.finish()
        except OSError as exc:  # the periodic save failed: the save below covers its step and more
            self._pending.clear()
            emit(self.events, {"event": "save_failed", "error": f"{type(exc).__name__}: {exc}"})
            if self.ledger is not None:  # raised by the checkpointer's wait, before report_finished
                self.ledger.save_failed()
        step = trainer["successful_updates"]
        committed = self.store.is_complete(step)
        plan = None
        if self.ledger is not None:  # the final save planned against the notice's deadline
            plan = self.ledger.plan_notice(notice, trainer, self.saves[-1]["size_bytes"] if self.saves else None,
                                           committed)
        extra: dict[str, Any] = {}
        if committed:
            url, action = self.store.step_url(step), "already committed"
        elif plan is not None and plan.decision == "skip":
            last = self.ledger.last_committed
            url, action = (self.store.step_url(last) if last is not None else None), "skipped"
            extra = {"reason": plan.reason, "last_committed_step": last, "updates_lost": step - (last or 0)}
        else:
            emit(self.events, {"event": "save_begin", "step": step})
            url, action = self.save_now(trainer, teacher_state, reason="notice")["url"], "committed"
        record = {
            "event": "preempted",
            "source": notice.source,
            "detail": notice.detail,
            "step": step,
            "url": url,
            "action": action,
            "attempted_updates": trainer["attempted_updates"],
            "seconds": time.perf_counter() - started,
            "deadline_secs_left": self.ledger.secs_left(notice) if self.ledger is not None else notice.secs_left(),
            **extra,
        }
        emit(self.events, record)
        return record

    def _counting_failure(self, save: Callable[[], str]) -> str:
        """``save()``; a failure is counted by the ledger's metrics, then raised."""
        try:
            return save()
        except Exception:
            if self.ledger is not None:
                self.ledger.save_failed()
            raise

    def _record(self, step: int, url: str, seconds: float) -> dict[str, Any]:
        """The ``saved`` record; ``size_bytes`` is ``None`` when retention has already deleted the
        step (an asynchronous save reported after the next one committed, with ``keep_last=1``)."""
        try:
            size_bytes = self.store.manifest(step).total_size_bytes
        except CheckpointNotFoundError:
            size_bytes = None
        record = {"step": step, "url": url, "seconds": seconds, "size_bytes": size_bytes}
        self.saves.append(record)
        return record


__all__ = ["JobSaves", "emit"]
