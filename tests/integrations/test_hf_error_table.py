"""The Hugging Face rows of the backend-failure table: ``StoreCallback.on_save`` (synchronous, and
with ``async_upload``) x each backend failure, injected by the S3 fault proxy in front of moto.

Each row asserts the typed error the save raises (with ``async_upload``: the cause of the
``BackgroundSaveError`` raised at the next sync point), its chained cause, the URL of the step
and the file in its message, and that nothing was committed. The checkpoint directory holds a
11 MiB file uploaded in 5 MiB parts (S3's smallest): a refusal on its second write (the first part) must reach the
caller as the backend's refusal, not as a file that was read short.
"""

from __future__ import annotations

import os
import types

import pytest
from opd_testkit.hf import tiny_trainer
from opd_testkit.proxies import Rule
from transformers import TrainerControl

from opd_store import CheckpointStore
from opd_store.errors import (
    AmbiguousCommitError,
    BackgroundSaveError,
    PayloadUploadError,
    StoragePermissionError,
    StoreUnreachableError,
    ThrottledUploadError,
)
from opd_store.integrations.transformers import StoreCallback
from opd_store.job._machines import torch_threads

pytestmark = pytest.mark.xdist_group("hf-error-table")
"""One worker runs the module: its module fixture (a trained checkpoint) is built once."""

BIG_BYTES = 11 << 20  # above two parts: multipart, with a part refused after a first write


def _manifest(request) -> bool:
    return request.path.endswith("/manifest.json")


def _ambiguous_create() -> Rule:
    """The manifest's create fails (500 after the retries) and so does every read of it after:
    the outcome of the commit is unknown."""
    created: list[str] = []

    def match(request) -> bool:
        if _manifest(request) and request.method == "PUT":
            created.append(request.path)
        return _manifest(request) and bool(created)

    return Rule(match=match, fault="status", status=500, code="InternalError", times=None)


# name: (the proxy's rule, the error raised, what its message names besides the step's URL)
FAILURES = {
    "access-denied": (lambda: Rule(ops=("CreateMultipartUpload",), fault="status", status=403, code="AccessDenied",
                                   times=None),
                      StoragePermissionError, ["permission denied", "CreateMultipartUpload", "'big.bin'", "step 1"]),
    "unreachable": (lambda: Rule(match=lambda r: r.method in ("PUT", "POST"), fault="drop", times=None),
                    StoreUnreachableError, ["cannot write payload 'big.bin' of step 1", "step 1 is not committed"]),
    "throttled": (lambda: Rule(ops=("PutObject",), match=lambda r: not _manifest(r), fault="status", status=503,
                               code="SlowDown", times=None),
                  ThrottledUploadError, ["PutObject failed after the client's retries", "SlowDown"]),
    "refused-part": (lambda: Rule(ops=("UploadPart",), fault="status", status=500, code="InternalError", times=None),
                     PayloadUploadError, ["big.bin", "UploadPart 1 failed after the client's retries"]),
    "ambiguous-commit": (_ambiguous_create, AmbiguousCommitError, ["manifest create", "may or may not be committed"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``checkpoint-1`` of a one-step run (plus an 11 MiB file), its args and its state."""
    out = tmp_path_factory.mktemp("hf-errors")
    with torch_threads(1):
        trainer = tiny_trainer(str(out), max_steps=1, save_steps=1)
        trainer.train()
    (out / "checkpoint-1" / "big.bin").write_bytes(os.urandom(BIG_BYTES))
    return types.SimpleNamespace(args=trainer.args, state=trainer.state, model=trainer.model)


@pytest.mark.parametrize("async_upload", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_backend_failure_reaches_the_caller_typed_and_named(saved, s3_fault_proxy, failure, async_upload):
    backend, proxy = s3_fault_proxy
    rule, expected, named = FAILURES[failure]
    options = dict(backend.storage_options, part_size_bytes=5 << 20, retries=1, throttle_timeout_secs=0,
                   config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}})
    callback = StoreCallback(backend.url, storage_options=options, async_upload=async_upload)
    callback.on_train_begin(saved.args, saved.state, TrainerControl(), model=saved.model)
    proxy.add(rule())
    if async_upload:
        callback.on_save(saved.args, saved.state, TrainerControl())  # returns; the upload fails behind it
        with pytest.raises(BackgroundSaveError) as raised:
            callback.wait()
        error = raised.value.__cause__
        assert f"upload of step 1 to {backend.url}" in str(raised.value)
    else:
        with pytest.raises(OSError) as raised:
            callback.on_save(saved.args, saved.state, TrainerControl())
        error = raised.value
    assert type(error) is expected, repr(error)
    message = str(error)
    assert message.startswith(f"{backend.url}/step-000001"), message
    assert all(part in message for part in named), message
    assert error.__cause__ is not None  # the backend's own error, chained
    proxy.clear()
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert store.steps() == [] and callback.committed_steps == []
