"""Errors keep their meaning through every layer: each backend failure injected into each core write
path raises a typed error that names what failed, with the backend's error chained (docs/protocol.md,
"Errors"; the failures are translated once, in ``opd_store/storage/_backend_errors.py``).

The failures, injected by the S3 fault proxy in front of moto (:mod:`opd_testkit.proxies`), each on
its own step (a client with one retry, 2 s timeouts and ``throttle_timeout_secs=0``, so a failure
past its retries is quick):

==============  =====================================================  =================================
failure         injected                                               raised
==============  =====================================================  =================================
denied          ``PutObject`` of the step's payloads: 403 AccessDenied  ``StoragePermissionError`` (a
                                                                       ``PermissionError``) naming
                                                                       ``PutObject`` and the payload
throttled       ``PutObject``: 503 SlowDown past the retries           ``ThrottledUploadError`` (a
                                                                       ``PayloadUploadError``) naming
                                                                       the payload
refused part    ``UploadPart`` of a multipart payload: 500 past them   ``PayloadUploadError`` naming
                                                                       ``UploadPart``
ambiguous       the manifest ``PutObject`` lands and its reply is      ``AmbiguousCommitError`` (it may
                lost, then every read of the step is dropped           have committed; here it did)
unreachable     every connection closed                                ``StoreUnreachableError`` naming
                                                                       the endpoint
==============  =====================================================  =================================

The paths: a single save (``save_opd_checkpoint``), an asynchronous one (``AsyncCheckpointer``:
``handle.result()`` raises the error itself), DCP (``opd_store.dcp.save``), a tiered store's
upload (``UploadError`` at ``flush()``, the error above its cause), ``cp`` (``copy_checkpoint``),
and a multi-rank save of two gloo processes: every rank raises the same ``DistributedSaveError``
naming the failing rank and its error, of the class that keeps the meaning when every failing
rank's failure has it (``DistributedPermissionError``, ``DistributedUnreachableError``,
``DistributedAmbiguousCommitError``: still an ``AmbiguousCommitError``). Nothing committed is lost.
"""

from __future__ import annotations

import pytest
import torch
from core_rank_child import run_ranks
from opd_testkit import opd as objects
from opd_testkit.proxies import S3FaultProxy, through_proxy

from opd_store import CheckpointStore, TieredStore, dcp, save_opd_checkpoint
from opd_store.errors import (
    AmbiguousCommitError,
    DistributedAmbiguousCommitError,
    DistributedPermissionError,
    DistributedSaveError,
    DistributedUnreachableError,
    PayloadUploadError,
    StoragePermissionError,
    StoreUnreachableError,
    UploadError,
)
from opd_store.opd import AsyncCheckpointer
from opd_store.store import copy_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

FAST = dict(retries=1, config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}},
            connect_timeout_secs=2, read_timeout_secs=2, default_block_size=5 << 20, throttle_timeout_secs=0)
# failure -> (step, the error raised, a word of its message)
FAILURES = {
    "denied": (11, StoragePermissionError, "PutObject"),
    "throttled": (12, PayloadUploadError, "SlowDown"),
    "refused part": (13, PayloadUploadError, "UploadPart"),
    "ambiguous": (14, AmbiguousCommitError, "may or may not be committed"),
    "unreachable": (15, StoreUnreachableError, "closed the connection"),
}
BIG = 3 << 19  # float32 elements: a 6 MiB payload, above the 5 MiB upload block (multipart)


def arm(proxy: S3FaultProxy, failure: str, step: int, *, only: str = "") -> None:
    """Make ``failure`` happen to every request of ``step`` (``only``: to the payloads whose key ends so)."""
    key = f"step-{step:06d}/"

    def payload(request) -> bool:
        return key in request.path and not request.path.endswith("manifest.json") and request.path.endswith(only)

    if failure == "denied":
        proxy.add(ops=("PutObject",), match=payload, status=403, code="AccessDenied", times=None)
    elif failure == "throttled":
        proxy.add(ops=("PutObject",), match=payload, status=503, code="SlowDown", times=None)
    elif failure == "refused part":
        proxy.add(ops=("UploadPart",), match=lambda r: key in r.path, status=500, code="InternalError", times=None)
    elif failure == "ambiguous":
        landed: list[bool] = []

        def manifest_put(request) -> bool:
            if request.path.endswith(key + "manifest.json"):
                landed.append(True)
                return True
            return False

        proxy.add(ops=("PutObject",), match=manifest_put, fault="drop_after", times=None)
        proxy.add(match=lambda r: bool(landed) and (key in r.path or key in r.query), fault="drop", times=None)
    else:
        proxy.add(match=lambda r: key in r.path or key.rstrip("/") in r.query, fault="drop", times=None)


@pytest.fixture
def fast_proxy(moto_s3):
    """A clean bucket behind the fault proxy, with the fast client options; (Backend, proxy)."""
    proxy = S3FaultProxy(moto_s3.endpoint_url)
    try:
        yield through_proxy(moto_s3.new_backend(), proxy, **FAST), proxy
    finally:
        proxy.stop()


def _kwargs(store, step: int, failure: str) -> dict:
    teacher = {"update_count": step, **({"big": torch.zeros(BIG)} if failure == "refused part" else {})}
    return objects.save_kwargs(store, successful=step, teacher_state=teacher)


def _single(store, step, failure, tmp_path):
    return save_opd_checkpoint(**_kwargs(store, step, failure))


def _asynchronous(store, step, failure, tmp_path):
    checkpointer = AsyncCheckpointer()
    try:
        return checkpointer.save(**_kwargs(store, step, failure)).result()  # the failure itself, reported
    finally:
        checkpointer.close()


def _dcp(store, step, failure, tmp_path):
    return dcp.save({"w": torch.zeros(BIG) if failure == "refused part" else torch.arange(4.0)}, store, step)


def _tier_upload(store, step, failure, tmp_path):
    tiered = TieredStore(tmp_path / f"local-{step}", store)
    try:
        save_opd_checkpoint(**_kwargs(tiered, step, failure))  # committed on local disk
        tiered.flush()
    finally:
        try:
            tiered.close()
        except UploadError:
            pass  # reported by flush() already


def _cp(store, step, failure, tmp_path):
    source = CheckpointStore(tmp_path / f"source-{step}")
    save_opd_checkpoint(**_kwargs(source, step, failure))
    return copy_checkpoint(source, step, store)


PATHS = {"single save": _single, "async save": _asynchronous, "DCP": _dcp, "tier upload": _tier_upload, "cp": _cp}


def _causes(error: BaseException) -> list[BaseException]:
    chain, cause = [], error.__cause__
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    return chain


@pytest.mark.parametrize("path", PATHS)
def test_each_failure_raises_its_typed_error(path, fast_proxy, tmp_path):
    backend, proxy = fast_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert save_opd_checkpoint(**objects.save_kwargs(store, successful=1))  # committed before the failures
    for failure, (step, expected, word) in FAILURES.items():
        proxy.clear()
        arm(proxy, failure, step)
        with pytest.raises(Exception) as caught:
            PATHS[path](store, step, failure, tmp_path)
        error = caught.value
        if path == "tier upload":  # the local commit stands; the upload's error is the cause
            assert isinstance(error, UploadError) and f"upload of step {step}" in str(error), (failure, error)
            error = error.__cause__
        assert isinstance(error, expected), (path, failure, repr(error))
        message = str(error)
        assert f"{backend.url}/step-{step:06d}" in message and word in message, (path, failure, message)
        if failure in ("denied", "throttled", "refused part"):
            assert f"of step {step}" in message, message  # and the payload by name
        causes = _causes(error)
        assert causes, (path, failure)  # the backend's error stays chained
        if failure == "denied":
            assert any(isinstance(cause, PermissionError) for cause in causes)
        proxy.clear()
        assert store.is_complete(step) == (failure == "ambiguous"), (path, failure)  # here the create had landed
    assert store.is_complete(1) and store.read(1, "training_state.pt")


# -- several ranks ------------------------------------------------------------------------------


def test_a_multi_rank_save_keeps_each_failures_meaning_on_every_rank(fast_proxy, tmp_path):
    backend, proxy = fast_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    expected = {
        # failure: (the class every rank raises, the failing rank, its error, what it is also)
        "denied": (DistributedPermissionError, 1, "StoragePermissionError", PermissionError),
        "throttled": (DistributedSaveError, 1, "ThrottledUploadError", OSError),  # a PayloadUploadError
        "refused part": (DistributedSaveError, 0, "PayloadUploadError", OSError),
        "ambiguous": (DistributedAmbiguousCommitError, 0, "AmbiguousCommitError", AmbiguousCommitError),
        "unreachable": (DistributedUnreachableError, 0, "StoreUnreachableError", StoreUnreachableError),
    }
    for failure, (step, _error, _word) in FAILURES.items():
        arm(proxy, failure, step, only="rng-rank-01.pt" if failure in ("denied", "throttled") else "")
    reports = run_ranks(tmp_path / "ranks", url=backend.url, storage_options=backend.portable_options(),
                        steps=[[step, failure == "refused part"] for failure, (step, _e, _w) in FAILURES.items()])
    for failure, (step, _error, _word) in FAILURES.items():
        cls, failing, inner, also = expected[failure]
        seen = [report[f"save {step}"] for report in reports]
        assert {r["type"] for r in seen} == {cls.__name__}, (failure, seen)
        assert len({r["message"] for r in seen}) == 1  # the same error on every rank
        assert also.__name__ in seen[0]["bases"] and "DistributedSaveError" in seen[0]["bases"], seen[0]
        message = seen[0]["message"]
        assert f"{backend.url}/step-{step:06d}: step {step} " in message, message
        assert f"rank {failing} failed: {inner}: " in message and str(failing) in seen[0]["failures"], message
        assert inner in seen[failing]["causes"] or failure == "unreachable", seen[failing]  # chained on the failing rank
    proxy.clear()
    assert store.is_complete(FAILURES["ambiguous"][0])  # the ambiguous create had landed
    assert [s for s in store.steps() if s != FAILURES["ambiguous"][0]] == []
