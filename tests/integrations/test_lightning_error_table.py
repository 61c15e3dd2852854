"""Lightning's write path keeps each backend failure's meaning, as a table: a fault injected at the
S3 proxy once training has started (access denied, the endpoint gone, throttling past the client's
retries, a refused multipart part, a manifest create whose outcome cannot be read back) fails
``trainer.fit`` with the typed error a plain save raises, naming the payload's URL (so the name,
version and file), the step, and the request; the backend's error is chained as the cause, and no
version of the checkpoint is committed. Through ``AsyncCheckpointIO`` the same error object
reaches ``fit`` from the saving thread."""

from __future__ import annotations

import re

import lightning_child
import pytest
import torch

from opd_store import CheckpointStore
from opd_store.errors import AmbiguousCommitError, PayloadUploadError, StoragePermissionError, StoreUnreachableError

pytestmark = pytest.mark.timeout(300)

FAST_FAILURES = {"retries": 1, "config_kwargs": {"retries": {"total_max_attempts": 1}},
                 "throttle_timeout_secs": 0}
"""One attempt per request (s3fs's own loop and botocore's; a throttled one not sent again by the
pacer): a fault past retries at once."""


def _payload(op: str, **rule):
    return dict(ops=(op,), match=lambda r: r.path.endswith("/checkpoint.ckpt"), **rule)


def _manifest(op: str, **rule):
    return dict(ops=(op,), match=lambda r: r.path.endswith("/manifest.json"), **rule)


FAULTS = {
    "access-denied": ([_payload("PutObject", status=403, code="AccessDenied", times=None)], StoragePermissionError,
                      r"permission denied: the backend refused PutObject while writing payload 'checkpoint.ckpt' "
                      r"of step 1 \(Access Denied\); step 1 is not committed$", PermissionError),
    "unreachable": ([_payload("PutObject", fault="drop", times=None)], StoreUnreachableError,
                    r"cannot write payload 'checkpoint.ckpt' of step 1: endpoint http://127\.0\.0\.1:\d+ closed the "
                    r"connection", Exception),
    "throttled": ([_payload("PutObject", status=503, code="SlowDown", times=None)], PayloadUploadError,
                  r"PutObject failed after the client's retries \(.*\(throttled, SlowDown\)\); the upload is aborted",
                  OSError),
    "refused-part": ([dict(ops=("UploadPart",), status=500, code="InternalError", times=None)], PayloadUploadError,
                     r"UploadPart 1 failed after the client's retries \(.*internal error", OSError),
    "ambiguous-commit": ([_manifest("PutObject", fault="drop", times=None),
                          _manifest("GetObject", status=503, code="SlowDown", times=None)], AmbiguousCommitError,
                         r"the manifest create for attempt attempt-\S+ failed .* and reading it back failed too .*; "
                         r"the step may or may not be committed$", StoreUnreachableError),
}


@pytest.mark.parametrize("fault,async_io", [*((fault, False) for fault in FAULTS), ("access-denied", True)],
                         ids=[*FAULTS, "access-denied-async-checkpoint-io"])
def test_a_backend_failure_during_a_lightning_save_keeps_its_type_its_cause_and_names_the_file(
        fault, async_io, s3_fault_proxy):
    backend, proxy = s3_fault_proxy
    rules, raised, detail, cause = FAULTS[fault]
    options = dict(backend.storage_options, **FAST_FAILURES, part_size_bytes=5 << 20)

    class FaultOnceTraining(lightning_child.pl_callback()):
        def on_train_start(self, trainer, pl_module):
            for rule in rules:
                proxy.add(**rule)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if fault == "refused-part":  # above the part size: a multipart upload of two parts
                checkpoint["padding"] = torch.zeros((6 << 20) // 4)

    url = backend.url + "/ckpts"
    trainer, model, train, val, plugin, _c = lightning_child.build(url, options, max_epochs=1, async_io=async_io,
                                                                   callbacks=[FaultOnceTraining()])
    with pytest.raises(raised) as caught:
        trainer.fit(model, train, val)
    message = str(caught.value)
    name = r"(epoch=0-step=4|last)\.ckpt" if async_io else r"epoch=0-step=4\.ckpt"
    where = rf"{re.escape(url)}/{name}/step-000001" + ("" if raised is AmbiguousCommitError else r"/attempt-\S+/checkpoint\.ckpt")
    assert re.match(rf"^{where}: {detail}", message), message
    assert "\n" not in message and isinstance(caught.value.__cause__, cause)
    assert any(r.fault for r in proxy.requests)
    proxy.clear()
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        assert CheckpointStore(plugin.path_of(name), storage_options=backend.storage_options).steps() == []
