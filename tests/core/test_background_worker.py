"""The one background worker (asynchronous saves and tier uploads): order, deferred failures, RNG
isolation, what a task holds freed on the worker thread, and the exit sequence (wait, cancel, stop
and join, report)."""

from __future__ import annotations

import random
import threading
import weakref

import pytest

from opd_store.errors import SaveAbandonedError
from opd_store.pipeline import BackgroundWorker

DEADLINE_SECS = 60


def test_tasks_run_in_order_and_a_failure_is_reported_once():
    worker = BackgroundWorker("test-worker", exit_timeout_secs=5)
    seen: list[int] = []

    def fail() -> None:
        raise OSError("injected")

    first = worker.submit("first", 1, lambda: seen.append(1) or "one")
    failing = worker.submit("failing", 2, fail)
    third = worker.submit("third", 3, lambda: seen.append(3) or "three")
    worker.wait_idle(DEADLINE_SECS)
    assert seen == [1, 3] and first.value == "one" and third.result() == "three"
    assert failing.value is None and isinstance(failing.failure(), OSError)
    (unreported,) = worker.take_unreported()
    assert unreported is failing and worker.take_unreported() == []  # once
    again = worker.submit("again", 4, fail)
    with pytest.raises(OSError, match="injected"):
        again.result(DEADLINE_SECS)  # seen by the caller here ...
    assert worker.take_unreported() == []  # ... so not again at the next sync point
    worker.close()
    with pytest.raises(ValueError, match="closed"):
        worker.submit("late", 5, lambda: None)


def test_background_draws_never_move_the_callers_random_stream():
    random.seed(1234)
    expected = [random.random() for _ in range(5)]
    random.seed(1234)
    worker = BackgroundWorker("test-worker", exit_timeout_secs=5)
    drawn = worker.submit("draws", 1, lambda: [random.random() for _ in range(1000)])
    worker.wait_idle(DEADLINE_SECS)
    assert len(set(drawn.value)) == 1000
    assert [random.random() for _ in range(5)] == expected
    worker.close()


def test_exit_sequence_waits_then_cancels_a_stuck_task_and_joins_the_thread(capsys):
    events: list[tuple[str, list[str]]] = []
    worker = BackgroundWorker("test-exit", exit_timeout_secs=0.2, exit_join_secs=DEADLINE_SECS,
                              on_exit=lambda event, tasks: events.append((event, [t.label for t in tasks])))
    started = threading.Event()

    def stuck_until_cancelled() -> None:
        started.set()
        worker.cancelled.wait()  # a transaction watches this event the same way
        raise SaveAbandonedError("stopped at the exit deadline")

    stuck = worker.submit("stuck", 1, stuck_until_cancelled)
    queued = worker.submit("queued", 2, lambda: "never runs")
    assert started.wait(DEADLINE_SECS)
    thread = next(t for t in threading.enumerate() if t.name == "test-exit")
    worker.finish_at_exit()
    assert events == [("waiting", ["stuck", "queued"]), ("abandoned", ["stuck", "queued"]),
                      ("finished", ["stuck", "queued"])]
    assert not thread.is_alive()  # stopped and joined before the interpreter would finalise
    assert isinstance(stuck.failure(), SaveAbandonedError)
    assert isinstance(queued.failure(), SaveAbandonedError) and "abandoned before it started" in str(queued.failure())
    assert capsys.readouterr().err == ""


def test_exit_sequence_reports_a_thread_it_cannot_stop(capsys):
    release = threading.Event()
    worker = BackgroundWorker("test-blocked", exit_timeout_secs=0.1, exit_join_secs=0.1)
    started = threading.Event()
    worker.submit("blocked", 1, lambda: started.set() or release.wait(DEADLINE_SECS))
    assert started.wait(DEADLINE_SECS)
    worker.finish_at_exit()
    assert "background thread test-blocked is still inside a backend call at exit" in capsys.readouterr().err
    release.set()  # let the thread end (the interpreter would have been left to finalise it)
    worker.wait_idle(DEADLINE_SECS)


def test_a_finished_worker_exits_silently():
    events: list[str] = []
    worker = BackgroundWorker("test-idle", exit_timeout_secs=5, on_exit=lambda event, tasks: events.append(event))
    worker.submit("quick", 1, lambda: None).result(DEADLINE_SECS)
    worker.finish_at_exit()
    assert events == ["finished"]


def test_what_a_task_holds_is_freed_on_the_worker_thread():
    """A snapshot's tensors must not be freed by a thread racing the interpreter's finalization:
    the worker drops the task's callable and its failure's frame locals itself."""
    worker = BackgroundWorker("test-frees", exit_timeout_secs=5)
    freed_on: list[str] = []

    class Snapshot:  # stands for the staged tensors a save's closure holds
        pass

    def task(fail: bool):
        snapshot = Snapshot()
        weakref.finalize(snapshot, lambda: freed_on.append(threading.current_thread().name))

        def run() -> str:
            held = snapshot  # also a local of the frame a failure's traceback keeps
            if fail:
                raise OSError(f"injected with {type(held).__name__}")
            return "committed"

        return run

    ok = worker.submit("ok", 1, task(False))
    failing = worker.submit("failing", 2, task(True))
    worker.wait_idle(DEADLINE_SECS)
    assert freed_on == ["test-frees", "test-frees"]
    assert ok.value == "committed" and str(failing.failure()) == "injected with Snapshot"
    (note,) = failing.failure().__notes__  # the traceback, as text
    assert note.startswith("raised in a background worker thread:") and ", in run\n" in note
    assert failing.failure().__traceback__ is None
    worker.close()


def test_a_task_that_ignores_the_cancellation_is_stopped_in_its_thread(capsys):
    """A task waiting on a remote request (woken every 50 ms, as fsspec's sync loop is) that never
    looks at ``cancelled`` gets SaveAbandonedError raised in it after half the join time."""
    release = threading.Event()
    started = threading.Event()
    worker = BackgroundWorker("test-overrun", exit_timeout_secs=0.1, exit_join_secs=4)

    def waits_on_a_request() -> None:
        started.set()
        while not release.wait(0.05):
            pass

    stuck = worker.submit("overrun", 1, waits_on_a_request)
    assert started.wait(DEADLINE_SECS)
    thread = next(t for t in threading.enumerate() if t.name == "test-overrun")
    worker.finish_at_exit()
    assert not thread.is_alive() and not release.is_set()
    assert isinstance(stuck.failure(), SaveAbandonedError)
    assert "stopped by the exit sequence" in str(stuck.failure())
    assert capsys.readouterr().err == ""
