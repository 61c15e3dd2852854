"""Secrets: no credential (access key, secret key, session
token) and no signed URL appears in a manifest, a log line or an error message, checked with
distinctive fake credentials on moto through saves, loads and failures (missing bucket, 403s from
the proxy, a corrupt manifest).

Log lines are captured at DEBUG from every logger. botocore's own DEBUG logging is the one
exception, by botocore's design: its request dumps (logger ``botocore.endpoint``) include the signed headers (the access key id in
``Authorization: ... Credential=<key id>/...`` and the session token). That logging is off unless
an application turns botocore's DEBUG on; docs/protocol.md says so. The test proves the exception
is exactly that: no other logger, no manifest and no error carries a credential.
"""

from __future__ import annotations

import logging
import traceback

import pytest
import torch

from opd_store import CheckpointStore
from opd_store.errors import OpdStoreError

KEY = "AKIAOPDSTORELEAKTEST1"
SECRET = "opdStoreSecretKey/MustNeverLeak+0123456789"
TOKEN = "opdStoreSessionTokenMustNeverLeak0123456789abcdef"
SIGNED_URL_MARKERS = ("X-Amz-Signature", "X-Amz-Credential", "Signature=", "x-amz-security-token=")
BOTOCORE_LOGGERS = ("botocore", "aiobotocore")


def _options(endpoint_url: str) -> dict:
    return {"endpoint_url": endpoint_url, "key": KEY, "secret": SECRET, "token": TOKEN,
            "client_kwargs": {"region_name": "us-east-1"}}


def _leaks(text: str, *, credentials_only: bool = False) -> list[str]:
    found = [s for s in (KEY, SECRET, TOKEN) if s in text]
    if not credentials_only:
        found += [m for m in SIGNED_URL_MARKERS if m in text]
    return found


def _rendered(exc: BaseException) -> str:
    """str, repr and the full rendered traceback (chained causes' messages included)."""
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc))])


def test_no_credential_in_manifests_logs_or_errors(s3_proxy, moto_s3, caplog):
    backend, proxy = s3_proxy
    caplog.set_level(logging.DEBUG)
    store = CheckpointStore(backend.url, storage_options=_options(proxy.endpoint_url))
    errors: list[BaseException] = []

    # A save and a load.
    store.check_reachable()
    with store.begin(1, metadata={"successful_updates": 1}) as txn:
        with txn.open("model.pt") as writer:
            torch.save({"w": torch.arange(8)}, writer)
    assert torch.equal(torch.load(store.open(1, "model.pt"), weights_only=True)["w"], torch.arange(8))
    assert store.latest_step() == 1 and store.verify(1, deep=True).ok
    manifest_bytes = backend.raw_fs().cat_file(f"{backend.raw_root()}/step-000001/manifest.json")

    # Failures: a missing bucket, 403s on write and read, a corrupt manifest.
    missing = CheckpointStore("s3://no-such-bucket/run", storage_options=_options(proxy.endpoint_url))
    def write_and_commit():
        with missing.begin(2) as txn:  # the upload's failure is raised by the payload's close or the commit
            txn.write_bytes("a.bin", b"a")

    for action in (missing.check_reachable, lambda: missing.latest_step(), write_and_commit):
        with pytest.raises(Exception) as caught:
            action()
        errors.append(caught.value)
    proxy.add(ops=("PutObject",), status=403, code="AccessDenied", times=None)
    with pytest.raises(OSError) as caught:
        with store.begin(2) as txn:
            txn.write_bytes("a.bin", b"a")
    errors.append(caught.value)
    proxy.clear()
    proxy.add(ops=("GetObject",), status=403, code="AccessDenied", times=None)
    with pytest.raises(OSError) as caught:
        store.read(1, "model.pt")
    errors.append(caught.value)
    proxy.clear()
    backend.raw_fs().pipe_file(f"{backend.raw_root()}/step-000001/manifest.json", b"{not json")
    with pytest.raises(OpdStoreError) as caught:
        store.manifest(1)
    errors.append(caught.value)

    assert len(errors) == 6
    assert _leaks(manifest_bytes.decode()) == []
    for error in errors:
        assert _leaks(_rendered(error)) == [], _rendered(error)
    assert _leaks(repr(store)) == [] and _leaks(str(store.storage)) == []

    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert len(lines) > 10  # DEBUG capture really ran (s3fs, opd_store, botocore all log)
    ours = [(name, _leaks(text)) for name, text in lines
            if not name.startswith(BOTOCORE_LOGGERS) and _leaks(text)]
    assert ours == []
    # botocore's request dumps are the documented exception; nothing ever logs the secret key.
    assert [name for name, text in lines if SECRET in text] == []
