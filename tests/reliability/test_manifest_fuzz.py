"""Hostile manifests: every malformed, truncated, oversized or
wrong-version manifest gives :class:`ManifestError`, never another exception, and no path in a
manifest can leave its step's attempt prefix. Fuzzed with hypothesis (deterministic: derandomized)."""

from __future__ import annotations

import datetime as dt
import json
import posixpath

import pytest
from core.helpers import open_store
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from opd_store.errors import ManifestError
from opd_store.format import MAX_MANIFEST_BYTES, Manifest, PayloadEntry, Writer, check_payload_name, parse_manifest
from opd_store.store import LegacyReader

AID = "attempt-20260101T000000Z-0123456789ab"
URL = "memory://fuzz/step-000007/manifest.json"
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

HOSTILE_NAMES = [
    "", ".", "..", "../x", "a/../../b", "a/..", "./a", "a/./b", "/etc/passwd", "//x", "a//b", "a/",
    "s3://bucket/key", "gs://bucket/key", "file:///etc/passwd", "file:x", "memory://x", "C:\\Windows",
    "c:x", "a\\b", "..\\..\\x", "x\n", "x\r", "x\x00y", "x\ty", "\x7f", "a*", "a?", "a[0]", "{a,b}", "a#b",
]


def _valid(**overrides) -> dict:
    manifest = Manifest(
        step=7,
        attempt_id=AID,
        writer=Writer(host="h", pid=1),
        created_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        payloads=(PayloadEntry(name="model.pt", path=f"{AID}/model.pt", size_bytes=3, crc32c="0a0b0c0d"),),
        metadata={"successful_updates": 7},
    )
    raw = json.loads(manifest.to_json_bytes())
    raw.update(overrides)
    return raw


VALID_BYTES = json.dumps(_valid()).encode()
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _parse_or_manifest_error(data: bytes) -> Manifest | None:
    try:
        return parse_manifest(data, url=URL, expected_step=7)
    except ManifestError as exc:
        assert URL in str(exc) and "\n" not in str(exc) and "pydantic.dev" not in str(exc)  # one line
        return None


def test_the_valid_manifest_parses():
    manifest = parse_manifest(VALID_BYTES, url=URL, expected_step=7)
    assert manifest.step == 7 and manifest.payloads[0].path == f"{AID}/model.pt"


@FUZZ
@given(st.binary(max_size=4096))
@example(b"\xff\xfe")
@example(b"null")
@example(b"[]")
@example(b"1" * 5000)
@example(b"[" * 100_000)
@example(b'{"step": ' + b"9" * 5000 + b"}")
@example(b"NaN")
@example(b'"manifest"')
def test_arbitrary_bytes_give_manifest_error(data):
    assert _parse_or_manifest_error(data) is None


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID_BYTES) - 1))
def test_every_truncation_gives_manifest_error(length):
    assert _parse_or_manifest_error(VALID_BYTES[:length]) is None


@FUZZ
@given(st.sampled_from(sorted(_valid())), JSON)
def test_any_field_replaced_by_any_json_is_refused_or_valid(field, value):
    raw = _valid(**{field: value})
    result = _parse_or_manifest_error(json.dumps(raw).encode())
    if result is not None:  # only a value the schema allows can pass, and then it round-trips
        assert result.step == 7 and all(e.path == f"{result.attempt_id}/{e.name}" for e in result.payloads)


@FUZZ
@given(st.sampled_from(["payloads", "writer"]), st.sampled_from(["name", "path", "size_bytes", "crc32c", "host", "pid"]), JSON)
def test_nested_fields_replaced_by_any_json(section, field, value):
    raw = _valid()
    target = raw["payloads"][0] if section == "payloads" else raw["writer"]
    target[field] = value
    result = _parse_or_manifest_error(json.dumps(raw).encode())
    if result is not None:
        assert all(e.path == f"{result.attempt_id}/{e.name}" for e in result.payloads)


@pytest.mark.parametrize(("document", "problem"), [
    ({"a": 1}, "step: Field required (and 5 more problems)"),
    ([1], "(the document): Input should be a valid dictionary or instance of Manifest"),
    (_valid(step="seven"), "step: Input should be a valid integer"),
    (_valid(attempt_id=None, step=None), "step: Input should be a valid integer (and 1 more problem)"),
])
def test_valid_json_that_is_not_a_manifest_is_one_line_naming_the_first_problem(document, problem):
    """Before, pydantic's 20+ line report (with errors.pydantic.dev links) went into every caller's
    one line (``train``'s refusal, ``verify``, ``delete``, ``latest_complete_checkpoint``)."""
    with pytest.raises(ManifestError) as raised:
        parse_manifest(json.dumps(document).encode(), url=URL)
    assert str(raised.value) == f"unreadable manifest at {URL}: not a manifest: {problem}"


@pytest.mark.parametrize("version", [0, 3, -1, 10**30, "1", 1.5, None, True])
def test_wrong_version_or_format(version):
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(_valid(format_version=version)).encode(), url=URL)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(_valid(format="orbax.commit")).encode(), url=URL)


def test_oversized_manifest_refused_before_parsing():
    padded = VALID_BYTES + b" " * (MAX_MANIFEST_BYTES + 1 - len(VALID_BYTES))
    with pytest.raises(ManifestError, match=f"larger than the {MAX_MANIFEST_BYTES}-byte limit"):
        parse_manifest(padded, url=URL)
    assert parse_manifest(padded[:MAX_MANIFEST_BYTES], url=URL).step == 7  # the limit itself passes


def test_writing_an_oversized_manifest_is_refused(local_backend):
    store = open_store(local_backend)
    with pytest.raises(ManifestError, match="over the"):
        with store.begin(1, metadata={"blob": "x" * MAX_MANIFEST_BYTES}) as txn:
            txn.write_bytes("a.bin", b"a")
    assert store.steps() == []
    assert store.checkpoints() == []  # the aborted attempt removed its payload


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_payload_names_are_refused(name):
    with pytest.raises(ValueError):
        check_payload_name(name)
    raw = _valid()
    raw["payloads"][0].update(name=name, path=f"{AID}/{name}")
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(raw).encode(), url=URL)


@pytest.mark.parametrize("path", [f"{AID}/../step-000001/{AID}/model.pt", "attempt-20260101T000000Z-ffffffffffff/model.pt",
                                  "model.pt", f"/{AID}/model.pt", f"s3://b/{AID}/model.pt", f"{AID}//model.pt"])
def test_a_path_that_differs_from_attempt_and_name_is_refused(path):
    raw = _valid()
    raw["payloads"][0]["path"] = path
    with pytest.raises(ManifestError, match="outside attempt"):
        parse_manifest(json.dumps(raw).encode(), url=URL)


@pytest.mark.parametrize("attempt_id", [AID + "\n", "../" + AID, AID + "/x", "attempt-x"])
def test_a_malformed_attempt_id_is_refused(attempt_id):
    raw = _valid(attempt_id=attempt_id)
    raw["payloads"][0]["path"] = f"{attempt_id}/model.pt"
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(raw).encode(), url=URL)


@FUZZ
@given(st.text(max_size=40))
@example("..")
@example("a/../b")
@example("s3://x")
@example("x\u2215y")
@example("\u00e9t\u00e9.pt")
def test_an_accepted_name_stays_inside_the_attempt_prefix(name):
    try:
        check_payload_name(name)
    except ValueError:
        return
    prefix = f"root/step-000007/{AID}"
    joined = f"{prefix}/{name}"
    assert posixpath.normpath(joined) == joined  # nothing to collapse: no "..", ".", "//"
    assert joined.startswith(prefix + "/") and len(joined) > len(prefix) + 1
    assert ":" not in name and "\\" not in name and all(ord(ch) >= 32 and ch != "\x7f" for ch in name)


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_a_hostile_manifest_in_a_store_is_corrupt_never_complete(backend):
    store = open_store(backend)
    with store.begin(7) as txn:
        txn.write_bytes("model.pt", b"abc")
    raw = backend.raw_fs()
    root = backend.raw_root()
    hostile = _valid(attempt_id=txn.attempt_id)
    hostile["payloads"][0].update(name="../../step-000001/x", path=f"{txn.attempt_id}/../../step-000001/x")
    for data in (json.dumps(hostile).encode(), b"[" * 100_000, b" " * (MAX_MANIFEST_BYTES + 10)):
        raw.pipe_file(f"{root}/step-000007/manifest.json", data)
        assert store.status(7) == "corrupt"
        assert store.is_complete(7) is False
        with pytest.raises(ManifestError):
            store.manifest(7)
        assert store.steps() == [7]  # listed (its manifest object exists), never complete


def test_a_legacy_step_refuses_names_that_leave_its_prefix(local_backend, tmp_path):
    store = open_store(local_backend)
    step_dir = tmp_path / "store" / "step-000004"
    step_dir.mkdir(parents=True)
    (step_dir / "COMPLETE").write_bytes(b"")
    (step_dir / "training_state.pt").write_bytes(b"legacy")
    (tmp_path / "store" / "secret.txt").write_bytes(b"outside the step")
    legacy = LegacyReader(store)
    assert legacy.read(4, "training_state.pt") == b"legacy"
    for name in ("../secret.txt", "/etc/passwd", "file:///etc/passwd", "..\\secret.txt"):
        with pytest.raises(ValueError):
            legacy.read(4, name)
