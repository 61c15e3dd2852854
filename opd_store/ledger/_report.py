"""``opd-store report``: the journal and the manifests turned into what a spot user asks.

:func:`build_report` is pure (events, stored bytes, prices in; :class:`LedgerReport` out);
:func:`report_store` reads them from a store. The rules (starts and outcomes, preemptions and
updates lost, goodput, restart time, overhead, requests and cost, the recommended interval):
docs/ledger.md, "opd-store report URL".
"""

from __future__ import annotations

import statistics
from typing import Any

from pydantic import BaseModel

from ..format import JOURNAL_PREFIX
from ..store import BaseStore, CheckpointStore
from ._journal import read_journal
from ._planning import young_daly_secs
from ._prices import PriceTable, table_for_url

ASSUMPTIONS = ("Young/Daly first-order optimum sqrt(2 x save cost x MTBF): preemptions arrive as a Poisson process "
               "(exponential times between them), a save costs much less than the time between preemptions, and "
               "every save costs the same; the save cost is the seconds a save blocks training")


class StartRow(BaseModel):
    """One start (process lifetime): times in seconds since the epoch, ``first_update_secs`` and
    ``update_secs`` in seconds, steps as the trainer's successful updates; ``outcome`` as in the
    module docstring."""

    index: int
    start_id: str
    host: str | None
    world_size: int | None
    process_started_secs: float | None
    ended_secs: float
    resumed_step: int | None
    last_step: int | None
    outcome: str
    first_update_secs: float | None
    update_secs: float
    saves: int


class PreemptionRow(BaseModel):
    """One preemption: the step the start reached, the step the next resumed from, the updates and
    update seconds lost (``exact``: progress was journaled after every update, or the start ended
    by a notice), and what came of its notice."""

    start_index: int
    how: str  # the notice's source, else "killed" or "failed"
    killed_secs: float
    last_step: int | None
    resumed_step: int | None
    updates_lost: int
    seconds_lost: float
    exact: bool
    notice_outcome: str | None  # committed in time / committed late / skipped / already committed / killed


class Commit(BaseModel):
    """One complete checkpoint, from its manifest: the trainer's step (a Lightning name's
    ``global_step``, else the store's step), its bytes, the committing process (``writer``) and the
    commit time (``created_at``, seconds since the epoch)."""

    step: int
    size_bytes: int
    host: str
    pid: int
    created_secs: float


class TimelineItem(BaseModel):
    """One mark of the timeline (seconds since the epoch)."""

    kind: str  # start, save, notice, kill, exit
    time_secs: float
    start_index: int
    label: str


class LostWork(BaseModel):
    """The span of a preempted start's work that the next start redid (seconds since the epoch)."""

    start_index: int
    from_secs: float
    to_secs: float
    updates: int


class Costs(BaseModel):
    """The estimate in the table's currency: the run's requests, and a month of the bytes stored."""

    table: str
    currency: str
    requests: float
    storage_per_month: float


class LedgerReport(BaseModel):
    """What ``opd-store report`` says (module docstring): seconds (``*_secs``), bytes (``*bytes*``),
    shares as fractions (``goodput``, ``checkpoint_share``), requests by kind, the recommended
    interval in seconds and in updates (``None`` until a preemption was measured), and the
    journal objects skipped (one line each). ``saves`` counts the journal's save events and the
    complete checkpoints whose event was lost (``saves_without_event``: a kill right after the commit;
    their seconds are unknown)."""

    url: str
    starts: list[StartRow]
    preemptions: list[PreemptionRow]
    wall_secs: float
    kept_update_secs: float
    goodput: float | None
    restart_secs_median: float | None
    restart_secs_worst: float | None
    saves: int
    blocking_secs_per_save: float | None
    blocking_secs_total: float
    checkpoint_share: float | None
    saves_without_event: int = 0
    bytes_stored: int
    journal_bytes: int
    requests: dict[str, int]
    costs: Costs | None
    mean_update_secs: float | None
    recommended_interval_secs: float | None
    recommended_every_updates: int | None
    assumptions: str
    timeline: list[TimelineItem]
    lost_work: list[LostWork]
    skipped: list[str]


def _update_secs_at(events: list, step: int, floor_step: int | None) -> float:
    """Update seconds a start had spent when it reached ``step`` (0 at or below its own resume
    step ``floor_step``), from its events with a step and update seconds (linear between two)."""
    if step <= (floor_step or 0):
        return 0.0
    points = sorted({(e.step, e.update_secs) for e in events if hasattr(e, "update_secs") and hasattr(e, "step")})
    if not points:
        return 0.0
    below = [(s, u) for s, u in points if s <= step]
    above = [(s, u) for s, u in points if s >= step]
    if below and below[-1][0] == step:
        return below[-1][1]
    low = below[-1] if below else ((floor_step or 0), 0.0)
    if not above:
        return low[1]
    high = above[0]
    return low[1] + (high[1] - low[1]) * (step - low[0]) / max(1, high[0] - low[0])


def build_report(events: list, *, url: str, bytes_stored: int = 0, journal_bytes: int = 0,
                 prices: PriceTable | None = None, skipped: list[str] | None = None,
                 commits: list[Commit] | None = None) -> LedgerReport:
    """The report of one store's journal (docs/ledger.md for every rule).

    Args:
        events (list): the journal's events, in order.
        url (str): the store.
        bytes_stored (int): bytes of the complete checkpoints now.
        journal_bytes (int): bytes of the journal.
        prices (PriceTable | None): the cost table; no cost without one.
        skipped (list[str] | None): events the reader skipped (carried into the report).
        commits (list[Commit] | None): the complete checkpoints: a start reached at least the steps it
            committed and the step the next start resumed from (its events may end earlier: a kill
            loses what it had not journaled), and a commit whose save event is missing counts as a save.
    """
    by_start: dict[str, list] = {}
    for event in events:
        by_start.setdefault(event.start_id, []).append(event)
    groups = list(by_start.values())
    resumes = [next((e.resumed_step for e in group if e.kind == "resume"), None) for group in groups]
    committed = _commits_by_start(groups, commits or [])
    starts: list[StartRow] = []
    timeline: list[TimelineItem] = []
    journaled_steps: list[int | None] = []  # the highest step of each start's events with update seconds
    unjournaled = 0
    for index, group in enumerate(groups):
        kinds = {e.kind: e for e in group}
        start, exit_ = kinds.get("start"), kinds.get("exit")
        stepped = [e for e in group if getattr(e, "step", None) is not None]
        with_secs = [e for e in group if hasattr(e, "update_secs")]
        outcome = exit_.outcome if exit_ else ("killed" if index < len(groups) - 1 else "running")
        first = kinds.get("first_update")
        journaled_steps.append(max((e.step for e in with_secs if hasattr(e, "step")), default=resumes[index]))
        next_resumed = resumes[index + 1] if index + 1 < len(groups) else None
        reached = [e.step for e in stepped] + [c.step for c in committed[index]] + [
            s for s in (resumes[index], next_resumed) if s is not None]
        lost_events = _without_event(group, committed[index])
        unjournaled += len(lost_events)
        starts.append(StartRow(
            index=index, start_id=group[0].start_id, host=group[0].host, world_size=group[0].world_size,
            process_started_secs=start.process_started_secs if start else None,
            ended_secs=max([group[-1].time_secs] + [c.created_secs for c in committed[index]]),
            resumed_step=resumes[index], last_step=max(reached, default=None), outcome=outcome,
            first_update_secs=first.secs_from_process_start if first else None,
            update_secs=max((e.update_secs for e in with_secs), default=0.0),
            saves=sum(1 for e in group if e.kind == "save") + len(lost_events)))
        for commit in lost_events:
            timeline.append(TimelineItem(kind="save", time_secs=commit.created_secs, start_index=index,
                                         label=f"save of step {commit.step} (committed; its journal event lost)"))
        for event in group:
            if event.kind == "start":
                timeline.append(TimelineItem(kind="start", time_secs=event.time_secs, start_index=index,
                                             label=f"start {index} on {event.host}"))
            elif event.kind == "save":
                timeline.append(TimelineItem(kind="save", time_secs=event.time_secs, start_index=index,
                                             label=f"save of step {event.step} ({event.blocking_secs:.2f} s blocking)"))
            elif event.kind == "notice":
                timeline.append(TimelineItem(kind="notice", time_secs=event.time_secs, start_index=index,
                                             label=f"notice ({event.source}): {event.decision}"))
            elif event.kind == "exit":
                timeline.append(TimelineItem(kind="exit", time_secs=event.time_secs, start_index=index,
                                             label=f"exit: {event.outcome} at step {event.step}"))
        if outcome == "killed":
            timeline.append(TimelineItem(kind="kill", time_secs=starts[-1].ended_secs, start_index=index,
                                         label=f"killed after step {starts[-1].last_step}"))

    preemptions: list[PreemptionRow] = []
    lost_work: list[LostWork] = []
    kept = 0.0
    for index, (row, group) in enumerate(zip(starts, groups)):
        if index == len(starts) - 1:
            kept += row.update_secs
            continue
        resumed = starts[index + 1].resumed_step
        kept_secs = min(row.update_secs, _update_secs_at(group, resumed or 0, row.resumed_step))
        kept += kept_secs
        if row.outcome not in ("killed", "preempted", "failed"):
            continue
        notice = next((e for e in group if e.kind == "notice"), None)
        notice_outcome = None
        if notice is not None:
            notice_save = next((e for e in group if e.kind == "save" and e.reason == "notice"), None)
            if notice.decision != "save":
                notice_outcome = "skipped" if notice.decision == "skip" else "already committed"
            elif notice_save is None:
                notice_outcome = "killed"
            elif notice.deadline_secs is None or notice_save.time_secs <= notice.time_secs + notice.deadline_secs:
                notice_outcome = "committed in time"
            else:
                notice_outcome = "committed late"
        start_event = next((e for e in group if e.kind == "start"), None)
        exact = row.outcome == "preempted" or (start_event is not None and start_event.progress_every_secs == 0)
        updates_lost = max(0, (row.last_step or 0) - (resumed or 0))
        preemptions.append(PreemptionRow(
            start_index=index, how=notice.source if notice is not None else row.outcome, killed_secs=row.ended_secs,
            last_step=row.last_step, resumed_step=resumed, updates_lost=updates_lost,
            seconds_lost=max(0.0, row.update_secs - kept_secs), exact=exact, notice_outcome=notice_outcome))
        kept_event = next((e for e in group if getattr(e, "step", None) == resumed and e.kind in ("save", "progress")),
                          None)
        lost_work.append(LostWork(start_index=index, from_secs=kept_event.time_secs if kept_event else group[0].time_secs,
                                  to_secs=row.ended_secs, updates=updates_lost))

    began = min((r.process_started_secs or groups[i][0].time_secs for i, r in enumerate(starts)), default=0.0)
    ended = max((r.ended_secs for r in starts), default=began)
    wall = max(0.0, ended - began)
    restarts = [r.first_update_secs for r in starts if r.resumed_step is not None and r.first_update_secs is not None]
    saves = [e for e in events if e.kind == "save"]
    blocking = [e.blocking_secs for e in saves]
    requests: dict[str, int] = {}
    for group in groups:
        exit_ = next((e for e in group if e.kind == "exit"), None)
        counts = [exit_.requests] if exit_ is not None else [e.requests for e in group if e.kind == "save"]
        if exit_ is None:
            counts.append({"put": len(group)})
        for count in counts:
            for kind, value in count.items():
                requests[kind] = requests.get(kind, 0) + value
    update_secs_total = sum(r.update_secs for r in starts)
    updates_done = sum(max(0, (step or 0) - (r.resumed_step or 0)) for r, step in zip(starts, journaled_steps))
    mean_update = update_secs_total / updates_done if updates_done else None
    interval = None
    if preemptions and blocking and wall > 0:
        interval = young_daly_secs(statistics.fmean(blocking), wall / len(preemptions))
    costs = None
    if prices is not None:
        costs = Costs(table=prices.name, currency=prices.currency, requests=prices.request_cost(requests),
                      storage_per_month=prices.storage_cost_per_month(bytes_stored + journal_bytes))
    return LedgerReport(
        url=url, starts=starts, preemptions=preemptions, wall_secs=wall, kept_update_secs=kept,
        goodput=kept / wall if wall > 0 else None,
        restart_secs_median=statistics.median(restarts) if restarts else None,
        restart_secs_worst=max(restarts) if restarts else None,
        saves=len(saves) + unjournaled, saves_without_event=unjournaled,
        blocking_secs_per_save=statistics.fmean(blocking) if blocking else None,
        blocking_secs_total=sum(blocking), checkpoint_share=sum(blocking) / wall if wall > 0 else None,
        bytes_stored=bytes_stored, journal_bytes=journal_bytes, requests=requests, costs=costs,
        mean_update_secs=mean_update, recommended_interval_secs=interval,
        recommended_every_updates=(max(1, round(interval / mean_update)) if interval is not None and mean_update
                                   else None),
        assumptions=ASSUMPTIONS, timeline=sorted(timeline, key=lambda t: t.time_secs), lost_work=lost_work,
        skipped=list(skipped or []))


def _commits_by_start(groups: list[list], commits: list[Commit]) -> list[list[Commit]]:
    """Each start's commits: a commit belongs to the newest start begun (first event) before it among
    those of its writer's host and pid (all starts when none is the writer's: another rank committed)."""
    out: list[list[Commit]] = [[] for _ in groups]
    for commit in commits:
        writers = [i for i, g in enumerate(groups) if (g[0].host, g[0].pid) == (commit.host, commit.pid)]
        began = [i for i in (writers or range(len(groups))) if groups[i][0].time_secs <= commit.created_secs]
        if began:
            out[began[-1]].append(commit)
    return out


def _without_event(group: list, commits: list[Commit]) -> list[Commit]:
    """The commits of a start beyond its save events of the same step (a kill right after a commit
    loses the event written in the background; Lightning commits one step under several names)."""
    journaled: dict[int, int] = {}
    for event in group:
        if event.kind == "save":
            journaled[event.step] = journaled.get(event.step, 0) + 1
    lost = []
    for commit in sorted(commits, key=lambda c: c.created_secs):
        if journaled.get(commit.step, 0) > 0:
            journaled[commit.step] -= 1
        else:
            lost.append(commit)
    return lost


def report_store(store: BaseStore, *, prices: PriceTable | None = None, use_default_prices: bool = True
                 ) -> LedgerReport:
    """The report of ``store``: its journal and the manifests of its complete checkpoints.

    Args:
        store (BaseStore): the store (its durable tier on a tiered store).
        prices (PriceTable | None): the cost table; default the URL scheme's built-in one.
        use_default_prices (bool): ``False``: no cost without ``prices``.

    Raises:
        OSError: a listing or read failed (a damaged event is skipped, never raised).
    """
    durable = store.durable_store()
    contents = read_journal(durable)
    commits = _commits(durable)
    if prices is None and use_default_prices:
        prices = table_for_url(durable.url)
    return build_report(contents.events, url=durable.url, bytes_stored=sum(c.size_bytes for c in commits),
                        journal_bytes=contents.size_bytes, prices=prices, skipped=contents.skipped, commits=commits)


def _commits(store: CheckpointStore, *, nested: bool = True) -> list[Commit]:
    """``store``'s complete checkpoints (one manifest read each); with ``nested``, a store with no step
    of its own lists the stores one level below (the Lightning plugin's root: a store per name).
    """
    infos = store.checkpoints()
    if not infos and nested:
        prefixes, _objects = store.storage.list_children("")
        names = [prefix.rstrip("/") for prefix in prefixes if prefix.rstrip("/") != JOURNAL_PREFIX]
        return [commit for name in names for commit in _commits(
            CheckpointStore(f"{store.url.rstrip('/')}/{name}", storage_options=store.storage_options), nested=False)]
    out = []
    for info in infos:
        if info.status == "complete":
            manifest = store.manifest(info.step)
            trainer_step = manifest.metadata.get("global_step")
            out.append(Commit(step=trainer_step if type(trainer_step) is int and trainer_step >= 0 else manifest.step,
                              size_bytes=manifest.total_size_bytes, host=manifest.writer.host, pid=manifest.writer.pid,
                              created_secs=manifest.created_at.timestamp()))
    return out


def report_lines(report: LedgerReport) -> list[str]:
    """The report as text lines (what ``opd-store report`` prints without ``--json``)."""
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    lines = [f"store: {report.url}",
             f"starts: {len(report.starts)} ({', '.join(r.outcome for r in report.starts) or 'none'}); "
             f"wall time {report.wall_secs:.1f} s"]
    lines.append("goodput: " + ("-" if report.goodput is None else
                                f"{report.goodput:.1%} ({report.kept_update_secs:.1f} s of kept updates)"))
    for row in report.preemptions:
        notice = f", notice {row.notice_outcome}" if row.notice_outcome else ""
        bound = "" if row.exact else "at least "
        lines.append(f"preemption of start {row.start_index} ({row.how}{notice}): reached step {row.last_step}, "
                     f"next start resumed from {row.resumed_step if row.resumed_step is not None else 'scratch'}: "
                     f"{bound}{row.updates_lost} updates and {row.seconds_lost:.2f} s lost")
    lines.append(f"restart to first update: median {secs(report.restart_secs_median)}, "
                 f"worst {secs(report.restart_secs_worst)}")
    share = "-" if report.checkpoint_share is None else f"{report.checkpoint_share:.1%} of the wall time"
    lost = report.saves_without_event
    lost_events = f" ({lost} save{'s' if lost != 1 else ''} without {'its' if lost == 1 else 'their'} journal event)"
    lines.append(f"checkpoint overhead: {report.saves} saves{lost_events if lost else ''}, "
                 f"{secs(report.blocking_secs_per_save)} blocking per save, {report.blocking_secs_total:.2f} s in all "
                 f"({share})")
    requests = ", ".join(f"{kind} {count}" for kind, count in sorted(report.requests.items()) if count) or "none"
    lines.append(f"stored: {report.bytes_stored} bytes in checkpoints, {report.journal_bytes} bytes of journal; "
                 f"requests: {requests}")
    if report.costs is not None:
        c = report.costs
        lines.append(f"estimated cost ({c.table}): requests {c.requests:.4f} {c.currency}, storage "
                     f"{c.storage_per_month:.4f} {c.currency} per month")
    if report.recommended_interval_secs is not None:
        every = (f" (about {report.recommended_every_updates} updates)"
                 if report.recommended_every_updates is not None else "")
        lines.append(f"recommended interval: {report.recommended_interval_secs:.1f} s{every}; {report.assumptions}")
    else:
        lines.append("recommended interval: - (no preemption measured yet)")
    for line in report.skipped:
        lines.append(f"skipped: {line}")
    return lines


def report_json(report: LedgerReport) -> dict[str, Any]:
    """The report as a JSON-ready dict (``--json``)."""
    return report.model_dump(mode="json")


__all__ = ["ASSUMPTIONS", "Commit", "LedgerReport", "build_report", "report_json", "report_lines", "report_store"]
