"""The one table of backend failures (:mod:`opd_store.storage._backend_errors`): what each backend
really raises, produced by the real clients against the real emulators (moto behind a fault proxy,
fake-gcs-server, the local filesystem), and what opd_store does with each meaning."""

from __future__ import annotations

import os

import pytest
from core.helpers import boto3_client, open_store, save
from gcsfs.retry import HttpError, validate_response

from opd_store import CheckpointStore, CommitConflictError
from opd_store.errors import StoragePermissionError
from opd_store.storage import Meaning, backend_operation, classify, describe
from opd_store.store import pin
from opd_store.testing import Fault, FaultyStorage

# Retries are what these tests count: botocore's back-offs between them are recorded, not slept.
pytestmark = pytest.mark.usefixtures("botocore_backoff")


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is what is examined
        return exc
    raise AssertionError("no exception was raised")


def test_s3_412_precondition_failed_is_a_lost_race(s3_backend, moto_s3):
    client = boto3_client(moto_s3)
    bucket, _, prefix = s3_backend.url[len("s3://"):].partition("/")
    client.put_object(Bucket=bucket, Key=f"{prefix}/m.json", Body=b"1", IfNoneMatch="*")
    exc = _raised(lambda: client.put_object(Bucket=bucket, Key=f"{prefix}/m.json", Body=b"2", IfNoneMatch="*"))
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert classify(exc) is Meaning.LOST_RACE
    storage = open_store(s3_backend).storage  # the same through s3fs's own translation
    exc = _raised(lambda: storage.create_exclusive("m.json", b"3"))
    assert classify(exc) is Meaning.LOST_RACE and storage.read_bytes("m.json") == b"1"


def test_s3_409_conditional_request_conflict_is_a_lost_race_and_never_commits(s3_proxy):
    backend, proxy = s3_proxy
    store = open_store(backend)
    proxy.add(ops=("PutObject",), match=lambda r: r.path.endswith("/manifest.json"), status=409,
              code="ConditionalRequestConflict", times=None)
    exc = _raised(lambda: store.storage.create_exclusive("step-000009/manifest.json", b"{}"))
    assert classify(exc) is Meaning.LOST_RACE and "ConditionalRequestConflict" in describe(exc)
    with pytest.raises(CommitConflictError, match="refused but no manifest is there now"):
        save(store, 1, {"model.bin": b"m"})
    assert store.steps() == [] and store.storage.list_tree("step-000001") == {}  # the attempt was deleted


def test_s3_403_404_and_throttling(s3_proxy):
    backend, proxy = s3_proxy
    store = CheckpointStore(backend.url, storage_options=dict(
        backend.storage_options, config_kwargs={"retries": {"max_attempts": 1, "mode": "legacy"}}))
    save(store, 1, {"model.bin": b"m"})
    rel = f"step-000001/{store.manifest(1).attempt_id}/model.bin"
    assert classify(_raised(lambda: store.storage.read_bytes("step-000001/none.bin"))) is Meaning.NOT_FOUND
    proxy.add(ops=("GetObject",), status=403, code="AccessDenied", times=1)
    denied = _raised(lambda: store.storage.read_bytes(rel))
    assert classify(denied) is Meaning.DENIED and backend_operation(denied) == "GetObject"
    proxy.add(ops=("GetObject",), status=503, code="SlowDown", times=None)
    throttled = _raised(lambda: store.storage.read_bytes(rel))
    assert classify(throttled) is Meaning.THROTTLED and "SlowDown" in describe(throttled)


def test_gcs_412_is_a_lost_race(gcs_backend):
    storage = open_store(gcs_backend).storage
    storage.create_exclusive("m.json", b"1")
    exc = _raised(lambda: storage.create_exclusive("m.json", b"2"))
    assert classify(exc) is Meaning.LOST_RACE and storage.read_bytes("m.json") == b"1"
    assert classify(_raised(lambda: storage.read_bytes("none.json"))) is Meaning.NOT_FOUND


@pytest.mark.parametrize("status,meaning", [(412, Meaning.LOST_RACE), (404, Meaning.NOT_FOUND),
                                            (403, Meaning.DENIED), (401, Meaning.DENIED),
                                            (429, Meaning.THROTTLED), (503, Meaning.THROTTLED),
                                            (500, Meaning.OTHER)])
def test_gcs_statuses_as_gcsfs_raises_them(status, meaning):
    # gcsfs's own response check turns each status into what its callers see (a 403 becomes a
    # plain OSError("Forbidden: ..."), a 412 a FileExistsError, a 429 an HttpError).
    exc = _raised(lambda: validate_response(status, b'{"error": {"message": "m"}}', "b/o"))
    assert classify(exc) is meaning


def test_local_lost_race_and_missing(tmp_path):
    storage = CheckpointStore(tmp_path / "store").storage
    storage.create_exclusive("a/m.json", b"1")
    assert classify(_raised(lambda: storage.create_exclusive("a/m.json", b"2"))) is Meaning.LOST_RACE
    assert classify(_raised(lambda: storage.read_bytes("a/none.json"))) is Meaning.NOT_FOUND
    assert classify(_raised(lambda: os.open(tmp_path / "nowhere" / "x", os.O_RDONLY))) is Meaning.NOT_FOUND
    assert classify(PermissionError(13, "Permission denied")) is Meaning.DENIED
    assert classify(ValueError("bad")) is Meaning.OTHER and classify(KeyboardInterrupt()) is Meaning.OTHER


def test_a_denied_payload_upload_is_a_permission_error_on_gcs_too(tmp_path):
    # gcsfs reports a 403 as OSError("Forbidden: ..."), not PermissionError: the table still names it.
    forbidden = _raised(lambda: validate_response(403, b'{"error": {"message": "denied"}}', "b/o"))
    assert not isinstance(forbidden, PermissionError)
    store = CheckpointStore(tmp_path / "store")
    faulty = CheckpointStore.from_storage(
        FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "write", exc=forbidden)))
    with pytest.raises(StoragePermissionError, match="permission denied.*payload 'model.bin' of step 1"):
        save(faulty, 1, {"model.bin": b"m"})
    assert store.steps() == []


def test_a_pin_that_lost_the_create_race_is_already_there(s3_backend):
    store = open_store(s3_backend)
    save(store, 1, {"model.bin": b"m"})
    assert pin(store, 1) is True and pin(store, 1) is False  # the second create got S3's 412


def test_unknown_http_errors_are_other():
    assert classify(HttpError({"code": 500, "message": "boom"})) is Meaning.OTHER


def test_a_message_that_only_introduces_its_cause_keeps_the_cause():
    """botocore's validation errors put the cause on the line after ``Parameter validation failed:``."""
    from botocore.exceptions import ParamValidationError

    exc = ParamValidationError(report='Invalid bucket name "": Bucket name must match the regex "^[a-z]"')
    assert describe(exc) == ('ParamValidationError: Parameter validation failed: Invalid bucket name "": '
                             'Bucket name must match the regex "^[a-z]"')
    assert describe(OSError("one line\nsecond line")) == "OSError: one line"


@pytest.mark.parametrize("url", ["s3://", "s3:///", "gs://", "s3a://"])
def test_a_bucket_url_without_a_bucket_is_refused_without_io(url):
    with pytest.raises(ValueError) as caught:
        CheckpointStore(url)
    scheme = url.split("://")[0]
    assert str(caught.value) == (f"{url}: the URL names no bucket (expected {scheme}://BUCKET or "
                                 f"{scheme}://BUCKET/PREFIX)")


def test_a_profile_that_does_not_exist_is_missing_credentials_named_in_one_line(moto_s3, tmp_path, monkeypatch, capsys):
    """A ``profile`` storage option (or ``AWS_PROFILE``) naming no profile of the AWS config file:
    botocore raises ``ProfileNotFound`` when the client is built. Every verb and the CLI say so in
    one line, as for missing credentials; nothing is written."""
    from opd_store import StoreUnreachableError
    from opd_store.cli import main

    config = tmp_path / "aws-config"
    config.write_text("[profile other]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    backend = moto_s3.new_backend()
    store = CheckpointStore(backend.url, storage_options=dict(backend.storage_options, profile="no-such-profile"))
    cause = "no credentials: The config profile (no-such-profile) could not be found"
    with pytest.raises(StoreUnreachableError) as caught:
        store.steps()
    assert str(caught.value) == f"{backend.url}: cannot list: {cause}"
    assert classify(caught.value.__cause__ or caught.value.__context__) is Meaning.NO_CREDENTIALS
    assert main(["ls", backend.url, "--s3-endpoint-url", moto_s3.endpoint_url,
                 "--storage-option", "profile=no-such-profile"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"opd-store ls: error: {backend.url}: cannot list the store: {cause}"]
    assert boto3_client(moto_s3).list_objects_v2(Bucket=backend.url.split("/")[2]).get("KeyCount") == 0


FAST_S3 = dict(retries=1, config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}},
               connect_timeout_secs=2, read_timeout_secs=2)


@pytest.mark.parametrize(("status", "code", "error", "builtin"), [
    (503, "SlowDown", "StoreRequestError", OSError),
    (500, "InternalError", "StoreRequestError", OSError),
    (403, "AccessDenied", "StoragePermissionError", PermissionError),
])
def test_a_read_refused_past_the_retries_is_typed_naming_the_url_and_operation(s3_fault_proxy, status, code, error,
                                                                               builtin):
    """Every read verb of a storage (listings, sizes, reads) answers a backend failure that is not a
    missing object with a typed error naming the object's URL, the operation and the backend's
    answer (a HEAD's reply has no body: its status line), the backend's error chained: the manifest probe of ``begin`` (HeadObject), a listing of
    the steps (ListObjectsV2) and a payload read (GetObject). Nothing committed changes."""
    import opd_store.errors as errors
    from opd_testkit.proxies import through_proxy

    backend, proxy = s3_fault_proxy
    store = open_store(through_proxy(backend, proxy, **FAST_S3))
    with store.begin(1) as txn:
        with txn.open("model.bin") as writer:
            writer.write(b"weights")
    for op, call, what in (("HeadObject", lambda: store.begin(2), "step-000002/manifest.json: cannot read its size"),
                           ("ListObjectsV2", store.steps, "cannot list"),
                           ("GetObject", lambda: store.read(1, "model.bin"), "/model.bin: cannot read")):
        proxy.clear()
        proxy.add(ops=(op,), match=lambda request: not request.path.endswith("manifest.json") or op == "HeadObject",
                  status=status, code=code, times=None)
        exc = _raised(call)
        assert type(exc).__name__ == error and isinstance(exc, builtin), repr(exc)
        assert isinstance(exc, getattr(errors, error)) and exc.__cause__ is not None
        answer = (code, str(status), {503: "Service Unavailable", 500: "Internal Server Error", 403: "Forbidden"}[status])
        assert what in str(exc) and store.url in str(exc) and any(word in str(exc) for word in answer), str(exc)
        faulted = {request.op for request in proxy.requests if request.fault}
        assert faulted == {op}
    proxy.clear()
    assert store.steps() == [1] and store.read(1, "model.bin") == b"weights"


@pytest.mark.parametrize(("typo", "meant"), [("s3:/bkt/run", "s3://bkt/run"), ("gcs:bkt", "gcs://bkt"),
                                             ("S3//bkt/run", "s3://bkt/run"), ("memory:x", "memory://x"),
                                             ("file:/tmp/run", "/tmp/run")])
def test_a_local_path_that_starts_like_a_url_is_refused_naming_the_url_meant(tmp_path, monkeypatch, typo, meant):
    """Every entry point that takes a store or checkpoint path refuses it (one rule,
    ``refuse_mistyped_url``) before any I/O; a Windows-like drive or an explicit ``./s3:`` is a path."""
    from opd_store.errors import UnsupportedBackendError
    from opd_store.opd._names import resolve_checkpoint
    from opd_store.store import split_checkpoint_url

    def refusal(text, url):
        return (f"{text}: looks like a mistyped store URL, not a local path (did you mean {url}?); "
                f"write ./{text} for a local directory of that name")

    monkeypatch.chdir(tmp_path)
    step = f"{typo}/step-000002"
    for call, line in ((lambda: CheckpointStore(typo), refusal(typo, meant)),
                       (lambda: split_checkpoint_url(step), refusal(step, f"{meant}/step-000002")),
                       (lambda: resolve_checkpoint(step), refusal(step, f"{meant}/step-000002"))):
        exc = _raised(call)
        assert (type(exc), str(exc)) == (UnsupportedBackendError, line)
        assert isinstance(exc, ValueError)
    for path in ("./s3:/bkt", "C:/run", "run/s3:x"):
        assert CheckpointStore(path).url == str(tmp_path / path.removeprefix("./"))
    assert list(tmp_path.iterdir()) == []
