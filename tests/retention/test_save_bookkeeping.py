"""A save's requests beyond its own payloads stay the same as the run's history grows: the
retention pass after a save (:mod:`opd_store.retention._after_save`) reads each step once per store
instance, and at most ``READS_PER_PASS`` steps it has not seen per pass, while protecting what the
full pass protects.

Requests are counted at the store's own client (botocore ``before-send``) against moto's server;
the committed history (``keep_every`` milestones) is written straight into moto's backend, as
``tests/core/test_requests.py`` does (over HTTP it would take minutes). 1,000 kept steps are
measured by ``python -m bench.simulation --bookkeeping`` (docs/performance.md).
"""

from __future__ import annotations

import datetime as dt

import pytest
from opd_testkit.stores import open_store

from opd_store.format import Manifest, PayloadEntry, Writer, crc32c_hex
from opd_store.pipeline import AfterCommit
from opd_store.retention import READS_PER_PASS, RetentionPolicy, RunLineage, collect_garbage
from opd_store.store import pin

POLICY = RetentionPolicy(keep_last=3, keep_every=10)
PAYLOADS = 2  # the payloads' own requests are not counted; fewer keep the test fast


def _aid(step: int) -> str:
    return f"attempt-20260101T000000Z-{step:012x}"


def _committed(put, step: int, metadata: dict | None = None) -> None:
    """Step ``step``, committed: one payload and its manifest, written without opd_store."""
    data = f"step {step}".encode()
    aid = _aid(step)
    put(f"step-{step:06d}/{aid}/state.bin", data)
    manifest = Manifest(step=step, attempt_id=aid, writer=Writer(host="fixture", pid=1),
                        created_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
                        payloads=(PayloadEntry(name="state.bin", path=f"{aid}/state.bin", size_bytes=len(data),
                                               crc32c=crc32c_hex(data)),),
                        metadata=metadata or {})
    put(f"step-{step:06d}/manifest.json", manifest.to_json_bytes())


@pytest.fixture
def history(moto_s3):
    """``write(steps, bucket=...)``: committed steps written into an S3 location (a bucket of its
    own per name, created clean on first use); returns its backend."""
    import dataclasses

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    first = moto_s3.new_backend(bucket="opd-history")
    s3 = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backends = {"opd-history": first}

    def write(steps, metadata: dict | None = None, bucket: str = "opd-history"):
        if bucket not in backends:
            moto_s3.create_bucket(bucket)
            backends[bucket] = dataclasses.replace(first, url=f"s3://{bucket}/runs/demo")
        for step in steps:
            _committed(lambda rel, data: s3.put_object(bucket, f"runs/demo/{rel}", data), step, metadata)
        return backends[bucket]

    return write


class Requests:
    """The HTTP requests one store's client sends (botocore ``before-send``: retries included)."""

    def __init__(self, store) -> None:
        store.storage.fs.connect()
        self.sent: list[tuple[str, str]] = []
        store.storage.fs.s3.meta.events.register("before-send.s3", self._record)

    def _record(self, request, **_kwargs):
        self.sent.append((request.method, request.url))

    def beyond_payloads(self) -> list[tuple[str, str]]:
        """Requests that are not the upload of a payload (a ``PUT`` under an attempt prefix)."""
        return [(m, u) for m, u in self.sent if not (m == "PUT" and "/attempt-" in u)]


def _save(store, step: int, requests: Requests) -> list[tuple[str, str]]:
    """A save of ``PAYLOADS`` small payloads with the policy's retention after it; its requests
    beyond the payloads."""
    requests.sent.clear()
    with store.begin(step) as txn:
        for index in range(PAYLOADS):
            txn.write_bytes(f"rank-{index}/state.bin", b"x" * 100)
    AfterCommit(store, step, retention=POLICY).run(txn.committed_url)
    assert len(requests.sent) - len(requests.beyond_payloads()) == PAYLOADS
    return requests.beyond_payloads()


def test_requests_beyond_the_payloads_do_not_grow_with_kept_steps(history):
    overheads = {}
    for kept in (10, 100):
        backend = history(range(10, 10 * kept + 1, 10), bucket=f"opd-kept-{kept}")  # milestones, all kept
        newest = 10 * kept
        store = open_store(backend)
        requests = Requests(store)
        cold = _save(store, newest + 1, requests)  # a new store instance: reads the window and its budget
        warm = [_save(store, newest + k, requests) for k in (2, 3, 4)]
        # 4 saves after the newest milestone with keep_last=3: the first is gone again.
        assert store.steps() == [*range(10, newest + 1, 10), newest + 2, newest + 3, newest + 4]
        overheads[kept] = (len(cold), [len(w) for w in warm])
    # Once the instance has read its history, the same requests whatever the history: the
    # commit's own (the existence checks of begin, the size check's listing, the manifest), a
    # delimiter listing of the root and one of the pins, and, when a step falls out of the window,
    # its fresh read, the pins again and its deletion (before: 34 requests at 13 kept steps, one
    # GET more per kept step).
    assert overheads[10] == overheads[100] == (12, [8, 8, 14]), overheads
    # The first save of an instance reads the two milestones of its keep-last window (a manifest
    # GET and a listing each), and no older one: milestones are kept whatever they hold.


def test_the_pass_after_a_save_protects_what_the_full_pass_protects(history):
    # A history longer than one pass reads: a resume parent (step 5) and a best step (6, the
    # Trainer's best checkpoint) named only by the resumed run's one checkpoint (20, a milestone),
    # a pinned step (7), and one nothing protects (9).
    run = RunLineage.new(parent_step=5)
    backend = history([5, 6, 7, 9])
    history([20], metadata={**run.as_metadata(), "best_step": 6})
    history(range(30, 30 + 10 * (READS_PER_PASS + 3), 10))
    store = open_store(backend)
    pin(store, 7)
    newest = store.steps()[-1]
    _save(store, newest + 1, Requests(store))
    # The pass read its window and READS_PER_PASS older steps: 9 lies below what it read, so is
    # kept for now, as are the parent and the pin.
    assert {5, 6, 7, 9, 20} <= set(store.steps())
    # Another instance's full pass reads everything: 9 goes, the parent, the best and the pin stay.
    report = collect_garbage(open_store(backend), POLICY, dry_run=False)
    assert report.deleted_steps == [9]
    # Later passes of the first instance read further back and decide as the full pass does:
    # step 3 (no milestone, nothing protects it) goes, the parent, the best and the pin stay.
    history([3])
    for k in (2, 3):
        _save(store, newest + k, Requests(store))
    assert 3 not in store.steps() and {5, 6, 7, 20} <= set(store.steps())
