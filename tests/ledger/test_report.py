"""The report's arithmetic on a journal whose every number is chosen (three starts: killed, preempted
by a notice whose save committed in time, finished), the planner of the final save and of
``--checkpoint-every auto``, the job's final save skipped when the deadline cannot be met, and the
Prometheus metrics with their documented names."""

from __future__ import annotations

import io
import math
import time
import urllib.request

import pytest

from opd_store import CheckpointStore
from opd_store.ledger import (
    BUILT_IN,
    SAFETY_FACTOR,
    SAFETY_SECS,
    AutoInterval,
    PrometheusExporter,
    SaveEstimator,
    build_report,
    plan_final_save,
    read_journal,
    report_lines,
    young_daly_secs,
)
from opd_store.runtime import PreemptionNotice

from ledger_events import EVENTS, progress_event, save_event, start_events  # noqa: I001 - tests/ledger's helpers


def test_the_report_of_a_chosen_journal():
    report = build_report(EVENTS, url="s3://b/run", bytes_stored=3 * 2**30, journal_bytes=0, prices=BUILT_IN["s3"])
    assert [(s.outcome, s.resumed_step, s.last_step, s.first_update_secs) for s in report.starts] == [
        ("killed", None, 4, 3.0), ("preempted", 2, 5, 4.0), ("finished", 5, 6, 6.0)]
    assert [(p.start_index, p.how, p.last_step, p.resumed_step, p.updates_lost, p.seconds_lost, p.exact,
             p.notice_outcome) for p in report.preemptions] == [
        (0, "killed", 4, 2, 2, 2.0, True, None), (1, "aws-spot", 5, 5, 0, 0.0, True, "committed in time")]
    assert report.wall_secs == 39.0 and report.kept_update_secs == 6.0  # 2 + 3 + 1
    assert report.goodput == 6.0 / 39.0
    assert (report.restart_secs_median, report.restart_secs_worst) == (5.0, 6.0)
    assert (report.saves, report.blocking_secs_per_save, report.blocking_secs_total) == (4, 0.625, 2.5)
    assert report.checkpoint_share == 2.5 / 39.0
    # the killed start: its save's requests and one PUT per event it journaled (7); the others' exit totals
    assert report.requests == {"put": 2 + 7 + 10 + 5, "list": 1}
    assert report.costs.requests == pytest.approx(25 * 0.005 / 1000)
    assert report.costs.storage_per_month == pytest.approx(3 * 0.023)
    assert report.mean_update_secs == 1.0  # 8 update seconds over 8 updates
    assert report.recommended_interval_secs == math.sqrt(2 * 0.625 * 39.0 / 2)
    assert report.recommended_every_updates == 5
    assert [t.kind for t in report.timeline] == ["start", "save", "kill", "start", "save", "notice", "save", "exit",
                                                 "start", "save", "exit"]
    assert [(w.start_index, w.from_secs, w.to_secs, w.updates) for w in report.lost_work] == [
        (0, 1003.0, 1006.0, 2), (1, 1017.0, 1020.0, 0)]
    lines = report_lines(report)
    assert ("preemption of start 0 (killed): reached step 4, next start resumed from 2: 2 updates and 2.00 s lost"
            in lines)
    assert "restart to first update: median 5.00 s, worst 6.00 s" in lines


def test_a_start_with_progress_events_apart_counts_its_lost_updates_as_a_bound():
    events = start_events(0.0, [progress_event(2.0, 3, 3.0)])
    events[0] = events[0].model_copy(update={"progress_every_secs": 60.0})
    events += start_events(10.0, [(12.0, "resume", dict(resumed_step=2, checkpoint_every=2))])
    report = build_report(events, url="u")
    (row,) = report.preemptions
    assert (row.updates_lost, row.exact, row.seconds_lost) == (1, False, 1.0)  # 3.0 s at step 3, 2.0 kept (linear)
    assert "at least 1 updates and 1.00 s lost" in report_lines(report)[3]


def test_a_kill_right_after_a_commit_is_bounded_by_the_manifests_and_the_next_resume():
    """A start killed right after committing step 4 lost that save's event (written in the background)
    and its progress past step 2: the manifests (writer host and pid, commit time) and the next
    start's resumed step say it reached step 4, and the save is counted without its event."""
    from opd_store.ledger import Commit

    def run(next_resumed):
        events = start_events(0.0, [(2.0, "resume", dict(resumed_step=None, checkpoint_every=2)),
                                    progress_event(3.0, 2, 2.0), save_event(4.0, 2, 0.5, 2.0)])
        return events + start_events(10.0, [(12.0, "resume", dict(resumed_step=next_resumed, checkpoint_every=2)),
                                            progress_event(13.0, 6, 2.0), save_event(14.0, 6, 0.5, 2.0)])

    commits = [Commit(step=step, size_bytes=100, host="h", pid=1, created_secs=t) for step, t in ((2, 4.5), (4, 8.0),
                                                                                                (6, 14.5))]
    report = build_report(run(4), url="u", commits=commits)
    assert [(s.last_step, s.saves) for s in report.starts] == [(4, 2), (6, 1)]
    assert [(p.last_step, p.resumed_step, p.updates_lost) for p in report.preemptions] == [(4, 4, 0)]
    assert (report.saves, report.saves_without_event, report.blocking_secs_total) == (3, 1, 1.0)
    assert report.mean_update_secs == 1.0  # 4 journaled update seconds over the 4 updates they timed
    assert [(t.time_secs, t.label) for t in report.timeline if t.kind in ("save", "kill")] == [
        (4.0, "save of step 2 (0.50 s blocking)"), (8.0, "save of step 4 (committed; its journal event lost)"),
        (8.0, "killed after step 4"), (14.0, "save of step 6 (0.50 s blocking)")]
    assert report_lines(report)[5].startswith("checkpoint overhead: 3 saves (1 save without its journal event), "
                                              "0.50 s blocking per save")
    # without the manifests (retention deleted them) the next start's resumed step still bounds it
    assert [(p.last_step, p.updates_lost) for p in build_report(run(4), url="u").preemptions] == [(4, 0)]
    # a next start that began again from scratch lost what the killed one committed
    (row,) = build_report(run(None), url="u", commits=commits).preemptions
    assert (row.last_step, row.resumed_step, row.updates_lost) == (4, None, 4)


def test_the_final_save_is_planned_against_the_deadline():
    assert plan_final_save(None, None).decision == "save"
    assert plan_final_save(2.0, None).reason == "no deadline known"
    assert plan_final_save(None, 10.0).reason == "no save measured yet"
    fits = 2.0 * SAFETY_FACTOR + SAFETY_SECS
    assert plan_final_save(2.0, fits).decision == "save"
    late = plan_final_save(2.0, fits - 0.01)
    assert (late.decision, late.reason) == ("skip", f"a save takes ~2.0 s (x{SAFETY_FACTOR:g} + {SAFETY_SECS:g} s "
                                                    f"margin), only {fits - 0.01:.1f} s left")
    assert (plan_final_save(None, -0.5).decision, plan_final_save(0.1, -0.5).reason) == (
        "skip", "the deadline passed 0.5 s ago")


def test_the_estimate_rests_on_this_runs_saves():
    estimator = SaveEstimator()
    assert estimator.estimate(100) is None
    estimator.observe(100, 1.0)
    estimator.observe(100, 2.0)
    estimator.observe(None, 50.0)  # unknown size: not used
    assert (estimator.estimate(None), estimator.estimate(200)) == (2.0, 4.0)  # the slowest, scaled by size
    fitted = SaveEstimator()
    for size in (100, 1000, 2000):
        fitted.observe(size, 1.0 + size / 100)  # 1 s fixed, 100 bytes/s
    assert fitted.estimate(500) == pytest.approx(6.0)


def test_auto_interval_moves_toward_young_daly_bounded_and_deterministic():
    assert young_daly_secs(0.5, 100.0) == 10.0
    with pytest.raises(ValueError):
        young_daly_secs(0.5, 0.0)

    def schedule(auto: AutoInterval) -> list[int]:
        steps = [auto.after_save(save_cost_secs=0.5, update_secs=1.0, survived_secs=5.0) for _ in range(4)]
        auto.mtbf_secs = None  # nothing measured: the 2 s survived are the bound, the interval shrinks
        return steps + [auto.after_save(save_cost_secs=0.5, update_secs=1.0, survived_secs=2.0)]

    assert schedule(AutoInterval(2, 100.0)) == [4, 8, 10, 10, 5] == schedule(AutoInterval(2, 100.0))
    assert AutoInterval(3, 100.0).after_save(save_cost_secs=0.5, update_secs=0.0, survived_secs=1.0) == 3


def test_a_notice_whose_deadline_passed_starts_no_save(tmp_path):
    from opd_store.job._ledger import JobLedger
    from opd_store.job._saving import JobSaves

    store = CheckpointStore(tmp_path / "store")
    ledger = JobLedger(store, group=None, updates=10, checkpoint_every=2, progress_every_secs=0,
                       notice_deadline_secs=2.0)
    ledger.start(None)
    ledger.resumed(None)

    def save(**_kwargs):
        raise AssertionError("a save was started")

    events = io.StringIO()
    saves = JobSaves(store, events, {}, async_save=False, save=save, ledger=ledger)
    notice = PreemptionNotice("SIGTERM", "received SIGTERM", time.monotonic() - 5.0, None)
    record = saves.on_notice(notice, {"successful_updates": 3, "attempted_updates": 3}, {})
    assert (record["action"], record["url"], record["last_committed_step"], record["updates_lost"]) == (
        "skipped", None, None, 3)
    assert record["reason"].startswith("the deadline passed 3.") and record["deadline_secs_left"] < -2.9
    notice_event = [e for e in read_journal(store).events if e.kind == "notice"][0]
    assert (notice_event.decision, notice_event.updates_lost, notice_event.step) == ("skip", 3, 3)
    # nothing but the journal in the store: no attempt started, so no orphan for gc
    assert store.steps() == [] and all(rel.startswith(".opd-store-journal/") for rel in store.storage.list_tree(""))


def test_a_bad_metrics_port_or_textfile_is_refused_naming_it(tmp_path):
    """Before, port 99999 reached bind() (``OverflowError``) and a textfile in a missing directory
    failed at each write naming a temporary file."""
    with pytest.raises(ValueError, match=r"^metrics port must be an int from 0 \(one the OS picks\) to 65535, got 99999$"):
        PrometheusExporter(port=99999, addr="127.0.0.1")
    missing = tmp_path / "no" / "m.prom"
    with pytest.raises(FileNotFoundError) as raised:
        PrometheusExporter(textfile=missing)
    assert str(raised.value) == f"metrics textfile {missing}: its directory does not exist"
    assert not (tmp_path / "no").exists()


def test_prometheus_metrics_by_their_documented_names(tmp_path):
    textfile = tmp_path / "opd.prom"
    exporter = PrometheusExporter(port=0, addr="127.0.0.1", textfile=textfile)
    try:
        for event in EVENTS:
            exporter.observe(event)
        exporter.save_failed()
        served = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    samples = {}
    for line in textfile.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples["opd_store_saves_total"] == 4 and samples["opd_store_saved_bytes_total"] == 400
    assert samples['opd_store_save_duration_seconds_count{phase="blocking"}'] == 4
    assert samples['opd_store_save_duration_seconds_sum{phase="blocking"}'] == 2.5
    assert samples["opd_store_save_failures_total"] == 1
    assert samples["opd_store_last_committed_step"] == 6
    assert samples["opd_store_lost_updates_total"] == 2  # the resume that redid 2
    assert samples["opd_store_resume_seconds"] == 6.0
    assert samples['opd_store_requests_total{kind="put"}'] == 8
    assert "opd_store_saves_total 4.0" in served
