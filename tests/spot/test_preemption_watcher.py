"""PreemptionWatcher: signals and the AWS/GCE notices of a fake metadata server on
loopback become ``should_checkpoint_now()``; every wait is on a real condition with a deadline."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from opd_store.runtime import PreemptionWatcher

DEADLINE_SECS = 60


def _poll(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def test_sigterm_sets_the_flag_and_stop_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher() as watcher:
        assert not watcher.should_checkpoint_now() and watcher.notice is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.wait(DEADLINE_SECS)
        assert watcher.should_checkpoint_now()
        assert (watcher.notice.source, watcher.notice.detail) == ("SIGTERM", "received SIGTERM")
        assert watcher.notice.secs_left() is None
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.timeout(DEADLINE_SECS)
def test_a_signal_landing_while_the_main_thread_is_inside_wait_does_not_deadlock():
    # The handler runs on the main thread between two bytecodes; here that thread holds the lock
    # of the Event behind wait(), as it does for an instant inside every wait(). A handler that set
    # that Event itself blocked on its own thread's lock forever.
    with PreemptionWatcher() as watcher:
        with watcher._noticed._cond:  # the instant inside Event.wait, held on purpose
            os.kill(os.getpid(), signal.SIGTERM)
            assert watcher.should_checkpoint_now() and watcher.notice.source == "SIGTERM"
        assert watcher.wait(DEADLINE_SECS)


def test_optional_signals_and_the_first_notice_wins():
    with PreemptionWatcher(signals=("SIGUSR1", "SIGINT")) as watcher:
        assert signal.getsignal(signal.SIGTERM) is not watcher._on_signal  # noqa: SLF001 - SIGTERM not taken
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.wait(DEADLINE_SECS)
        os.kill(os.getpid(), signal.SIGINT)  # handled by the watcher: no KeyboardInterrupt
        assert watcher.notice.source == "SIGUSR1"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown signal name"):
        PreemptionWatcher(signals=("SIGKILL",))
    with pytest.raises(ValueError, match="must be > 0"):
        PreemptionWatcher(poll_interval_secs=0)


def test_aws_spot_instance_action_notice_through_imdsv2(metadata_server):
    watcher = PreemptionWatcher(signals=(), aws_endpoint=metadata_server.endpoint, poll_interval_secs=0.02)
    with watcher:
        action = "/latest/meta-data/spot/instance-action"
        _poll(lambda: metadata_server.statuses(action).count(404) >= 3, "three polls without a notice")
        assert not watcher.should_checkpoint_now()
        metadata_server.tokens.clear()  # the token expired: the next poll gets 401 and renews it
        _poll(lambda: 401 in metadata_server.statuses(action), "a poll with the expired token")
        metadata_server.post_aws_notice(action="terminate", secs_ahead=120)
        assert watcher.wait(DEADLINE_SECS)
    notice = watcher.notice
    assert notice.source == "aws-spot"
    assert notice.detail == f"action=terminate time={metadata_server.aws_notice['time']}"
    assert 0 < notice.secs_left() <= 120
    assert metadata_server.statuses("/latest/api/token").count(200) == 2
    assert metadata_server.statuses(action)[-1] == 200


@pytest.mark.parametrize("wait_for_change", [False, True])
def test_gce_preempted_notice(metadata_server, wait_for_change):
    watcher = PreemptionWatcher(signals=(), gce_endpoint=metadata_server.endpoint, poll_interval_secs=0.05,
                                gce_wait_for_change=wait_for_change)
    path = "/computeMetadata/v1/instance/preempted"
    with watcher:
        _poll(lambda: len(metadata_server.statuses(path)) >= (1 if wait_for_change else 3), "polls")
        assert not watcher.should_checkpoint_now()
        metadata_server.post_gce_notice()
        assert watcher.wait(DEADLINE_SECS)
    assert (watcher.notice.source, watcher.notice.detail) == ("gce", "preempted=TRUE")
    assert 0 < watcher.notice.secs_left() <= 30
    assert set(metadata_server.statuses(path)) == {200}  # Metadata-Flavor: Google was sent every time
    if wait_for_change:
        assert any("wait_for_change=true" in p for _m, p, _s in metadata_server.requests)


def test_an_unreachable_metadata_server_is_no_notice(metadata_server):
    endpoint = metadata_server.endpoint
    metadata_server.stop()  # nothing listens there any more
    watcher = PreemptionWatcher(signals=(), aws_endpoint=endpoint, gce_endpoint=endpoint, poll_interval_secs=0.02)
    with watcher:
        _poll(lambda: watcher.polls["aws-spot"] >= 3 and watcher.polls["gce"] >= 3, "failed polls")
        assert not watcher.should_checkpoint_now()
