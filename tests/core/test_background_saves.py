"""The one owner of background saves (:class:`opd_store.pipeline.BackgroundSaves`), which the
asynchronous OPD save, the Hugging Face callback and the tier uploads share: one save in flight
when asked, a failure raised once at the next sync point, a timed-out close abandoning, and the
one exit report."""

from __future__ import annotations

import threading

import pytest

from opd_store.errors import BackgroundSaveError, SaveAbandonedError, SaveInFlightError, UploadError
from opd_store.pipeline import BackgroundSaves

DEADLINE_SECS = 60


def _fail(message: str):
    def run() -> None:
        raise OSError(message)

    return run


def test_one_save_in_flight_and_each_failure_raised_once_at_the_next_sync_point():
    saves = BackgroundSaves("opd-test-saves", exit_timeout_secs=5, owner="memory://run")
    gate = threading.Event()
    first = saves.submit("save of step 1", 1, lambda: gate.wait(DEADLINE_SECS) and "memory://run/step-000001")
    with pytest.raises(SaveInFlightError, match="the save of step 1 is still in flight"):
        saves.sync("the next save", when_busy="raise")
    assert saves.in_flight() is first
    gate.set()
    saves.sync("the next save")  # waits for it; nothing failed
    assert first.value == "memory://run/step-000001" and saves.in_flight() is None

    saves.submit("save of step 2", 2, _fail("disk full"))
    saves.wait(DEADLINE_SECS)
    with pytest.raises(BackgroundSaveError, match=r"^memory://run: the save of step 2 failed in the background "
                                                  r"\(reported at wait\(\)\): OSError: disk full$") as caught:
        saves.sync("wait()")
    assert isinstance(caught.value, OSError) and str(caught.value.__cause__) == "disk full"
    saves.sync("wait()")  # once

    saves.submit("save of step 3", 3, _fail("bucket gone"))
    saves.submit("retention after step 3", 3, _fail("delete refused"), follow_up=True)
    with pytest.raises(BackgroundSaveError, match=r"2 background failures \(reported at close\(\)\): the save of "
                                                  r"step 3 failed: OSError: bucket gone; the retention after step 3 "
                                                  r"failed: OSError: delete refused$") as caught:
        saves.close()
    assert str(caught.value.__cause__) == "bucket gone"
    assert not any(t.name == "opd-test-saves" for t in threading.enumerate())  # the thread has ended
    with pytest.raises(ValueError, match="opd-test-saves is closed"):
        saves.submit("save of step 4", 4, lambda: None)


def test_a_close_past_its_timeout_abandons_the_save_in_flight():
    saves = BackgroundSaves("opd-test-close", exit_timeout_secs=5, error=UploadError)
    started = threading.Event()

    def until_cancelled() -> None:
        started.set()
        assert saves.cancelled.wait(DEADLINE_SECS)  # a transaction watches this event the same way
        raise SaveAbandonedError("abandoned before its commit")

    task = saves.submit("upload of step 7", 7, until_cancelled)
    assert started.wait(DEADLINE_SECS)
    with pytest.raises(TimeoutError, match="upload of step 7 still in flight after 0.05 s"):
        saves.close(timeout_secs=0.05)
    assert task.wait(DEADLINE_SECS) and isinstance(task.failure(), SaveAbandonedError)


def test_the_one_exit_report(capsys):
    """Per save: waited for, abandoned past the deadline; per failure nobody saw; the newest save
    committed. Work that follows a save is named only when it failed; a closed owner is silent."""
    stuck = BackgroundSaves("opd-test-stuck", exit_timeout_secs=0.2, abandoned_note="the local tier keeps it")
    started = threading.Event()

    def until_cancelled() -> None:
        started.set()
        assert stuck.cancelled.wait(DEADLINE_SECS)
        raise SaveAbandonedError("stopped at the exit deadline")

    stuck.submit("save of step 1", 1, lambda: "memory://run/step-000001")
    stuck.submit("retention after step 1", 1, _fail("delete refused"), follow_up=True)
    stuck.submit("save of step 2", 2, until_cancelled)
    stuck.submit("retention after step 2", 2, lambda: None, follow_up=True)
    assert started.wait(DEADLINE_SECS)
    done = BackgroundSaves("opd-test-done", exit_timeout_secs=5)
    done.submit("save of step 5", 5, lambda: "memory://run/step-000005").result(DEADLINE_SECS)
    closed = BackgroundSaves("opd-test-closed", exit_timeout_secs=5)
    closed.submit("save of step 6", 6, _fail("nobody hears this"))
    with pytest.raises(BackgroundSaveError):
        closed.close()

    for saves in (stuck, done, closed):
        saves.worker.finish_at_exit()
    assert capsys.readouterr().err.splitlines() == [
        "opd_store: waiting up to 0.2 s for the save of step 2 to commit",
        "opd_store: abandoned the save of step 2 after 0.2 s; the local tier keeps it",
        "opd_store: the retention after step 1 failed: OSError: delete refused",
        "opd_store: the save of step 2 failed: SaveAbandonedError: stopped at the exit deadline",
        "opd_store: the retention after step 2 failed: SaveAbandonedError: retention after step 2 abandoned before "
        "it started: the exit deadline passed",
        "opd_store: save of step 5 committed: memory://run/step-000005",
    ]
