"""A journal whose every number is chosen, shared by the ledger's report tests: three starts (killed
at step 4 and resumed from 2; preempted by an AWS notice at step 5 whose save committed in time;
finished at step 6)."""

from __future__ import annotations

from opd_store.ledger._events import event_for

_IDS = iter(f"{n:016x}" for n in range(1, 100))


def start_events(process_started: float, events: list[tuple]) -> list:
    start_id = next(_IDS)
    return [event_for(kind, time_secs=t, start_id=start_id, seq=seq, host="h", pid=1, world_size=1, **fields)
            for seq, (t, kind, fields) in enumerate([(process_started + 1, "start", dict(
                process_started_secs=process_started, updates=6, checkpoint_every=2, progress_every_secs=0,
                store_url="s3://b/run", version="0")), *events])]


def save_event(t: float, step: int, blocking: float, update_secs: float, reason: str = "periodic") -> tuple:
    return (t, "save", dict(step=step, reason=reason, size_bytes=100, blocking_secs=blocking, commit_secs=blocking,
                            requests={"put": 2, "list": 1}, attempted_updates=step, update_secs=update_secs,
                            next_checkpoint_every=2))


def progress_event(t: float, step: int, update_secs: float) -> tuple:
    return (t, "progress", dict(step=step, attempted_updates=step, update_secs=update_secs))


def first_update_event(t: float, step: int, secs: float) -> tuple:
    return (t, "first_update", dict(step=step, attempted_updates=step, secs_from_process_start=secs, update_secs=1.0))


EVENTS = [
    *start_events(999.0, [  # killed at step 4; the next start resumes from 2
        (1001.0, "resume", dict(resumed_step=None, checkpoint_every=2)), first_update_event(1002.0, 1, 3.0),
        progress_event(1003.0, 2, 2.0), save_event(1004.0, 2, 0.5, 2.0), progress_event(1005.0, 3, 3.0), progress_event(1006.0, 4, 4.0)]),
    *start_events(1010.0, [  # an AWS notice at step 5: the save fits and commits in time
        (1012.0, "resume", dict(resumed_step=2, updates_redone=2, checkpoint_every=2)), first_update_event(1014.0, 3, 4.0),
        progress_event(1015.0, 4, 2.0), save_event(1016.0, 4, 0.5, 2.0), progress_event(1017.0, 5, 3.0),
        (1018.0, "notice", dict(source="aws-spot", detail="action=terminate", deadline_secs=10.0, step=5,
                                last_committed_step=4, decision="save", estimate_secs=0.6, updates_lost=0,
                                update_secs=3.0)),
        save_event(1019.0, 5, 1.0, 3.0, reason="notice"),
        (1020.0, "exit", dict(outcome="preempted", step=5, attempted_updates=5, update_secs=3.0, wall_secs=10.0,
                              requests={"put": 10}))]),
    *start_events(1030.0, [
        (1032.0, "resume", dict(resumed_step=5, updates_redone=0, checkpoint_every=2)), first_update_event(1036.0, 6, 6.0),
        save_event(1037.0, 6, 0.5, 1.0),
        (1038.0, "exit", dict(outcome="finished", step=6, attempted_updates=6, update_secs=1.0, wall_secs=8.0,
                              requests={"put": 5}))]),
]
