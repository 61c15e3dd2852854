"""Back-off that does not storm (opd_store/storage/transfers/_pacing.py): a store's uploads fly at
most at its adaptive limit, which halves on a throttled answer and grows back on successes;
throttled requests the client gave up on are sent again after a jittered back-off drawn from a
private generator until refused ``throttle_timeout_secs`` after their first refusal (on a virtual
clock here), then the save fails like any failed part; a save that spent more
than ``throttle_warn_share`` of its time throttled says so."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random

import pytest
from opd_testkit.proxies import Rule
from opd_testkit.simulation import lower_moto_min_part
from opd_testkit.stores import open_store

from opd_store import PayloadUploadError, ThrottledUploadError
from opd_store.storage.transfers import Pacer, Transfers, TransferSettings, paced

SMALL_PART = 64 << 10


class SlowDown(Exception):
    """What s3fs raises for a throttled answer: botocore's error response as its ``response``."""

    response = {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_throttled_answer_halves_the_concurrency_and_sets_a_send_rate_once_per_burst():
    clock = Clock()
    pacer = Pacer(8, clock=clock, seed=3)
    epochs = []
    for _ in range(20):  # 20 requests sent at t=0, 8 at most in flight
        epochs.append(asyncio.run(pacer.acquire()))
        pacer.release(epochs[-1], succeeded=False)
    assert pacer.rate() is None and pacer.next_send_in() == 0.0
    pacer.throttled(epochs[0])
    # 0.7 x the rate the store sent at over the last 2 s (20 requests: 10/s), and half the slots.
    assert (pacer.limit, pacer.rate()) == (4, 7.0)
    for epoch in epochs[1:]:  # the other answers of the same burst: no second cut
        pacer.throttled(epoch)
    assert (pacer.limit, pacer.rate()) == (4, 7.0) and 0 <= pacer.next_send_in() <= 1 / 7
    # Requests start 1/rate apart (+-50%): the store waits its turn.
    clock.now += pacer.next_send_in()
    later = asyncio.run(pacer.acquire())
    assert 0.5 / pacer.rate() <= pacer.next_send_in() <= 1.5 / pacer.rate()
    pacer.release(later, succeeded=True)
    # The rate grows linearly, doubling in 4 s; 5 s without a throttled answer end it.
    clock.now += 1.0
    assert pacer.rate() == pytest.approx(7.0 * (1 + clock.now / 4.0), rel=1e-9)
    clock.now = 5.0
    assert pacer.rate() is None and pacer.next_send_in() == 0.0
    stats = pacer.stats()
    assert (stats.throttled_answers, stats.retries, stats.rate) == (20, 0, None)
    assert stats.throttled_secs == 1.0  # from the first answer to a second without another


def test_the_concurrency_grows_back_with_successes():
    clock = Clock()
    pacer = Pacer(8, clock=clock)
    first = asyncio.run(pacer.acquire())
    pacer.throttled(first)
    pacer.release(first, succeeded=False)
    assert pacer.limit == 4
    successes = 0
    while pacer.limit < 8:
        clock.now += 10.0  # past every turn: only the concurrency limit is measured here
        pacer.release(asyncio.run(pacer.acquire()), succeeded=True)
        successes += 1
    assert successes == 24  # +1/limit each: about (8^2 - 4^2) / 2


def test_requests_wait_for_a_slot_while_the_limit_is_reached():
    async def scenario() -> list[str]:
        clock = Clock()
        pacer = Pacer(2, clock=clock)
        events = []
        first, second = await pacer.acquire(), await pacer.acquire()
        third = asyncio.ensure_future(pacer.acquire())
        await asyncio.sleep(0)
        events.append(f"third waiting: {not third.done()}")
        pacer.throttled(first)  # limit 1: two in flight, the third waits for both
        clock.now += 100.0  # past the send rate's turn (and its end)
        pacer.release(first, succeeded=False)
        await asyncio.sleep(0)
        events.append(f"after one release: {third.done()}")
        pacer.release(second, succeeded=True)  # limit 2 again
        third = await third
        events.append("third got its slot")
        fourth = await pacer.acquire()  # the second slot
        cancelled = asyncio.ensure_future(pacer.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()  # cancelled while waiting: it holds no slot
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        pacer.release(third, succeeded=True)
        pacer.release(fourth, succeeded=True)
        both = [await pacer.acquire(), await pacer.acquire()]  # two free slots, none leaked
        events.append(f"free slots: {len(both)}")
        return events

    assert asyncio.run(scenario()) == ["third waiting: True", "after one release: False", "third got its slot",
                                       "free slots: 2"]


def test_the_back_off_is_full_jitter_from_a_private_generator():
    pacer = Pacer(4, seed=7)
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    waits = [[pacer.backoff_secs(retry) for _ in range(200)] for retry in range(8)]
    assert [random.random() for _ in range(3)] == expected  # the training thread's stream is untouched
    for retry, drawn in enumerate(waits):
        bound = min(10.0, 0.2 * 2 ** retry)
        assert all(0 <= w <= bound for w in drawn) and max(drawn) > 0.8 * bound and min(drawn) < 0.2 * bound
    assert Pacer(4, seed=7).backoff_secs(0) == waits[0][0]  # seeded: the same draws


class VirtualTime:
    """A clock and a sleep that moves it: the pacer's waits take no wall time, and what it does at
    each instant is deterministic (seeded draws)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, secs: float) -> None:
        self.now += secs
        await asyncio.sleep(0)


def _refused_until(time: VirtualTime, admitted_at_secs: float | None, error: type[Exception] = SlowDown):
    """``(send, sends)``: a request refused until the virtual clock reaches ``admitted_at_secs``
    (``None``: always), and the virtual times it was sent at."""
    sends: list[float] = []

    async def send():
        sends.append(time.now)
        if admitted_at_secs is None or time.now < admitted_at_secs:
            raise error()
        return "stored"

    return send, sends


def test_a_request_refused_many_times_within_the_timeout_is_sent_until_it_lands():
    # A rank of a save behind one prefix: its own store has no success at all while the bucket
    # serves the other ranks; a count of refusals would fail it, the time from its first refusal
    # does not.
    time = VirtualTime()
    pacer = Pacer(8, throttle_timeout_secs=300, seed=1, clock=time.clock, sleep=time.sleep)
    send, sends = _refused_until(time, admitted_at_secs=240.0)
    assert asyncio.run(paced(pacer, send)) == "stored"
    assert len(sends) > 11 and sends[-2] < 240.0 <= sends[-1] < 300.0  # refused a dozen times and more, nothing of its store succeeding
    stats = pacer.stats()
    assert (stats.throttled_answers, stats.retries) == (len(sends) - 1, len(sends) - 1)
    # The back-off bound doubles per refusal up to 10 s; the turn under the send rate comes on top.
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    assert all(gap >= 0 for gap in gaps) and max(gaps) <= 10.0 + 1.5 / 0.02


def test_a_request_refused_past_the_timeout_fails_naming_how_long():
    time = VirtualTime()
    pacer = Pacer(8, throttle_timeout_secs=60, seed=1, clock=time.clock, sleep=time.sleep)
    send, sends = _refused_until(time, admitted_at_secs=None)
    with pytest.raises(ThrottledUploadError) as caught:
        asyncio.run(paced(pacer, send))
    # Sent again while within 60 s of its first refusal; the first refusal at 60 s or later fails it.
    assert sends[0] == 0.0 and sends[-2] < 60.0 <= sends[-1]
    assert f"throttled for {sends[-1]:.0f} s ({len(sends)} refusals)" in str(caught.value)
    assert "throttle_timeout_secs=60" in str(caught.value) and "SlowDown" in str(caught.value)
    assert isinstance(caught.value.__cause__, SlowDown) and isinstance(caught.value, PayloadUploadError)
    # A zero timeout fails at the first refusal; a failure that is not the store's rate is never retried.
    time = VirtualTime()
    send, sends = _refused_until(time, admitted_at_secs=None)
    with pytest.raises(ThrottledUploadError, match=r"throttled for 0 s \(1 refusals\)"):
        asyncio.run(paced(Pacer(8, throttle_timeout_secs=0, clock=time.clock, sleep=time.sleep), send))
    assert sends == [0.0]
    send, sends = _refused_until(time, admitted_at_secs=None, error=PermissionError)
    with pytest.raises(PermissionError):
        asyncio.run(paced(Pacer(8, clock=time.clock, sleep=time.sleep), send))
    assert len(sends) == 1


@pytest.mark.parametrize("bad", [-1, "300", True, float("inf")])
def test_a_throttle_timeout_that_is_not_a_number_of_seconds_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"storage option throttle_timeout_secs must be a number of seconds >= 0"):
        TransferSettings.pop_from({"throttle_timeout_secs": bad})
    assert TransferSettings.pop_from({}).throttle_timeout_secs == 300.0


def test_paced_cuts_the_limit_and_rate_on_each_refusal_and_grows_on_success():
    time = VirtualTime()
    pacer = Pacer(8, seed=1, clock=time.clock, sleep=time.sleep)
    send, sends = _refused_until(time, admitted_at_secs=1e-9)  # refused once per send at t=0 only
    assert asyncio.run(paced(pacer, send)) == "stored" and len(sends) == 2
    stats = pacer.stats()
    assert (stats.throttled_answers, stats.retries, stats.limit) == (1, 1, 4.25)  # halved, +1/4 by the success
    assert stats.rate is not None  # the retry waited its turn


@pytest.fixture
def throttled_s3(s3_fault_proxy):
    """A store through the fault proxy whose client does not retry (1 attempt, 1 pass of s3fs's
    loop), so the part writer's own retries are what a throttled answer meets."""
    backend, proxy = s3_fault_proxy

    def store(**options):
        config = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "legacy"}}, "retries": 1}
        return open_store(dataclasses.replace(backend, storage_options={**backend.storage_options, **config,
                                                                         **options}))

    return store, proxy


def test_a_throttled_payload_is_sent_again_and_the_save_commits_and_warns(throttled_s3, caplog):
    store_of, proxy = throttled_s3
    store = store_of(throttle_warn_share=0.0)
    rule = proxy.add(Rule(ops=("PutObject",), match=lambda r: "/attempt-" in r.path, times=3))
    with caplog.at_level(logging.WARNING, logger="opd_store.commit"), store.begin(1) as txn:
        txn.write_bytes("model.bin", b"weights" * 1000)
    assert rule.hits == 3 and proxy.count("PutObject", faulted=True) == 3
    assert store.read(1, "model.bin") == b"weights" * 1000
    stats = store.storage.transfers.pacer.stats()
    assert (stats.throttled_answers, stats.retries) == (3, 3) and stats.limit < 8
    warning = [r.getMessage() for r in caplog.records if "throttled by the store" in r.getMessage()]
    assert len(warning) == 1 and "the save of step 1 at" in warning[0] and "(3 throttled answers, 3 retries" in warning[0]


def test_a_throttled_save_past_its_timeout_fails_like_any_failed_part(throttled_s3):
    store_of, proxy = throttled_s3
    store = store_of(throttle_timeout_secs=0)
    store.storage.transfers = Transfers(TransferSettings(part_size_bytes=SMALL_PART, min_part_size_bytes=SMALL_PART,
                                                         throttle_timeout_secs=0))
    proxy.add(Rule(ops=("UploadPart",), times=None))
    with lower_moto_min_part(SMALL_PART), pytest.raises(ThrottledUploadError, match=r"UploadPart \d") as caught:
        with store.begin(1) as txn:
            txn.write_bytes("model.bin", bytes(range(256)) * (3 * SMALL_PART // 256))
    message = str(caught.value)
    assert "throttled for 0 s (1 refusals)" in message and "SlowDown" in message and "step-000001" in message
    assert "payload 'model.bin' of step 1 is not committed" in message
    # A zero timeout: every part sent is refused once and never sent again; the upload is aborted
    # once no part is in flight.
    sent = proxy.count("UploadPart")
    assert 1 <= sent <= 3 and proxy.count("UploadPart", faulted=True) == sent
    assert proxy.count("AbortMultipartUpload") == 1
    assert store.steps() == [] and store.storage.list_tree("") == {}
    assert store.storage.multipart_uploads().list() == []
