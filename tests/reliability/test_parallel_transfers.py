"""Parallel transfers on every object-store server of the suite (S3: moto and SeaweedFS; GCS:
fake-gcs-server), through a proxy that records every request: parts in flight at once from a bounded
pool of part buffers, several payloads of a save moving at once, ranged reads into one buffer, and
the faults of a transfer (a part that keeps failing, a connection cut, a short or altered range,
throttling). S3 uploads a payload as a multipart upload, GCS as temporary part objects composed
into it (:mod:`opd_testkit.transfer_dialects` names each store's requests).

Every store here uses S3's smallest part (5 MiB) so that a few MiB make a multipart upload.
"""

from __future__ import annotations

import threading

import pytest
from core.helpers import save
from opd_testkit.proxies import through_proxy
from opd_testkit.stores import open_store, raw_put
from opd_testkit.transfer_dialects import GCS, dialect_of, raw_backend, stored_keys

from opd_store import IntegrityError, PayloadUploadError, StoreUnreachableError
from opd_store.format import crc32c_base64
from opd_store.storage.gcs._composite import PART_MARKER
from opd_store.storage.transfers._parts import MIN_PART_SIZE_BYTES

PART = MIN_PART_SIZE_BYTES

# Retries are what these tests count: botocore's back-offs between them are recorded, not slept.
pytestmark = pytest.mark.usefixtures("botocore_backoff")


def _data(size_bytes: int, salt: int = 0) -> bytes:
    return bytes((i * 7 + salt) % 251 for i in range(251)) * (size_bytes // 251) + b"x" * (size_bytes % 251)


LARGE = _data(3 * PART + PART // 2)  # four parts: three whole ones and a half
# Where the part count is not what a test is about (a faulted part 2, ranged reads): two parts.
TWO_PARTS = _data(PART + PART // 2, 3)
SMALL = b"small payload " * 10


@pytest.fixture(params=["moto_s3", "seaweed_s3", "fake_gcs"])
def server(request):
    """One of the suite's object-store servers (moto's mock, SeaweedFS's production S3 server,
    fake-gcs-server)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def faulty(server):
    """A clean bucket behind the store's fault proxy: (backend with 5 MiB parts, 3 in flight, proxy)."""
    backend = server.new_backend()
    proxy = dialect_of(backend).fault_proxy(server.endpoint_url)
    try:
        yield through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=3), proxy
    finally:
        proxy.stop()


def _bucket(backend) -> str:
    return backend.url.partition("://")[2].partition("/")[0]


def _leftovers(server, backend) -> list:
    """What an upload left on the server: S3's open multipart uploads, GCS's temporary part objects."""
    if dialect_of(backend) is GCS:
        return [key for key in stored_keys(backend) if PART_MARKER in key]
    return server.boto3_client().list_multipart_uploads(Bucket=_bucket(backend)).get("Uploads", [])


def _parts(proxy, backend, name: str) -> list:
    """Forwarded part uploads of the payload ``name``."""
    return dialect_of(backend).parts(proxy, name)


def _saving(store, payloads: dict[str, bytes]) -> tuple[threading.Thread, list]:
    """``save(store, 1, payloads)`` on a thread of its own: (thread, outcome list)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(save(store, 1, payloads))
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- concurrency and memory -----------------------------------------------------------------------
def test_parts_go_up_at_once_and_the_pool_bounds_the_buffers(server):
    """Three parts are in flight at once (all held by the proxy), and the writer then waits for a
    part buffer: no fourth buffer is made while the three are in flight."""
    backend = server.new_backend()
    dialect = dialect_of(backend)
    proxy = dialect.hold_proxy(server.endpoint_url, dialect.is_part)
    try:
        store = open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=3))
        thread, outcome = _saving(store, {"model.bin": LARGE})
        proxy.wait_held(3)
        pool = store.storage.transfers.part_pool
        assert sorted(dialect.part_number(r) for r in proxy.requests if r.op == dialect.part_op) == [1, 2, 3]
        assert pool.stats()["in_flight"] == 3 and pool.stats()["allocated"] == 3
        assert thread.is_alive() and not outcome  # the writer waits for a buffer; nothing is committed
        assert store.steps() == []
        proxy.release()
        thread.join(120)
        assert outcome and not isinstance(outcome[0], BaseException), outcome
        parts = _parts(proxy, backend, "model.bin")
        assert sorted(r.request_bytes for r in parts) == [PART // 2, PART, PART, PART]
        assert proxy.count(dialect.assemble_op) == 1 and _leftovers(server, backend) == []
        # Three buffers were ever made; the last part went up from one of them (a view of its bytes,
        # the buffer never resized), and all three are kept for the next save.
        assert pool.stats() == {"in_use": 0, "in_flight": 0, "free": 3, "allocated": 3, "peak_in_use": 3}
        assert store.read(1, "model.bin") == LARGE
    finally:
        proxy.stop()


def test_the_next_payload_streams_while_the_last_parts_of_one_move(server):
    """``a.bin``'s last part and ``b.bin``'s completion are held at once: the save wrote ``b.bin``
    while ``a.bin`` was still uploading; the manifest comes last and lists both in write order."""
    first, second = _data(PART + PART // 2, 1), _data(PART + PART // 3, 2)
    backend = server.new_backend()
    dialect = dialect_of(backend)

    def hold(method: str, path: str) -> bool:
        if dialect is GCS:  # a.bin's part 2, b.bin's compose
            return ("a.bin.part-" in path and "-00002" in path) or path.endswith("b.bin/compose")
        last_part_of_a = method == "PUT" and "/a.bin?" in path and "partNumber=2" in path
        return last_part_of_a or (method == "POST" and "/b.bin?uploadId=" in path)

    proxy = dialect.hold_proxy(server.endpoint_url, hold)
    try:
        store = open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=4))
        thread, outcome = _saving(store, {"a.bin": first, "b.bin": second})
        proxy.wait_held(2)
        held = [r for r in proxy.requests
                if hold(r.method, r.path + (f"?{r.query}" if r.query else ""))]
        assert sorted(dialect.object_of(r).rpartition("/")[2] for r in held) == ["a.bin", "b.bin"]
        assert store.steps() == [] and proxy.count(dialect.create_op) == 0  # no manifest yet
        proxy.release()
        thread.join(120)
        assert outcome and not isinstance(outcome[0], BaseException), outcome
        assert [e.name for e in store.manifest(1).payloads] == ["a.bin", "b.bin"]
        ops = proxy.ops()
        manifest_put = next(i for i, r in enumerate(proxy.requests) if r.op == dialect.create_op)
        assert proxy.count(dialect.create_op) == 1  # the manifest's create (S3 names it: GCS's is in the body)
        assert dialect.object_of(proxy.requests[manifest_put]).endswith("/manifest.json") or dialect is GCS
        assert manifest_put > max(i for i, op in enumerate(ops) if op in (dialect.part_op, dialect.assemble_op))
        assert store.read(1, "a.bin") == first and store.read(1, "b.bin") == second
    finally:
        proxy.stop()


# -- faults of an upload --------------------------------------------------------------------------
@pytest.fixture
def gcsfs_backoff(monkeypatch) -> list[float]:
    """gcsfs's waits between the attempts of a request (seconds), recorded instead of slept."""
    import asyncio

    import gcsfs.retry

    waits: list[float] = []

    async def recorded_sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    # gcsfs.retry uses its asyncio module only to sleep between attempts.
    monkeypatch.setattr(gcsfs.retry, "asyncio", type("Backoff", (), {"sleep": staticmethod(recorded_sleep)}))
    return waits


UPLOAD_FAULTS = {
    "500": dict(fault="status", status=500, code="InternalError"),
    "cut": dict(fault="drop"),
    "slowdown": dict(fault="status", status=503, code="SlowDown"),
}


def _second_part_rule(proxy, backend, **fault):
    """Fault the upload of ``model.bin``'s second part (``times`` of them; once by default)."""
    dialect = dialect_of(backend)
    return proxy.add(ops=(dialect.part_op,), **{"times": 1, **fault},
                     match=lambda r: dialect.part_number(r) == 2 and dialect.names(r, "model.bin"))


@pytest.mark.parametrize("kind", sorted(UPLOAD_FAULTS))
def test_a_part_failing_once_is_retried_and_commits(faulty, server, kind):
    backend, proxy = faulty
    store = open_store(backend)
    rule = _second_part_rule(proxy, backend, **UPLOAD_FAULTS[kind])
    save(store, 2, {"model.bin": TWO_PARTS, "small.bin": SMALL})
    assert rule.hits == 1
    parts = _parts(proxy, backend, "model.bin")
    assert sorted(dialect_of(backend).part_number(r) for r in parts) == [1, 2]  # each once, after the retry
    assert sum(r.request_bytes for r in parts) == len(TWO_PARTS)
    assert store.read(2, "model.bin") == TWO_PARTS and store.read(2, "small.bin") == SMALL
    assert _leftovers(server, backend) == []


@pytest.mark.parametrize("server", ["moto_s3", "seaweed_s3"], indirect=True)
@pytest.mark.parametrize("times", [1, None])
def test_an_upload_created_twice_after_a_lost_reply_leaves_no_upload_open(faulty, server, times):
    """``CreateMultipartUpload`` lands but its reply is lost, and the client creates the upload
    again: the upload the writer never saw is aborted once the payload is settled, whether the
    save commits (lost once) or fails (lost every time: it is aborted too); no upload stays open."""
    backend, proxy = faulty
    store = open_store(backend)
    rule = proxy.add(ops=("CreateMultipartUpload",), fault="drop_after", times=times,
                     match=lambda r: dialect_of(backend).names(r, "model.bin"))
    if times == 1:
        save(store, 2, {"model.bin": TWO_PARTS})
        assert store.read(2, "model.bin") == TWO_PARTS
        assert rule.hits == 1 and proxy.count("CreateMultipartUpload") == 2
        assert proxy.count("AbortMultipartUpload") == 1 and proxy.count("CompleteMultipartUpload") == 1
    else:
        with pytest.raises(OSError, match="model.bin"):
            save(store, 2, {"model.bin": TWO_PARTS})
        assert store.steps() == [] and rule.hits == proxy.count("CreateMultipartUpload") >= 3
        assert proxy.count("AbortMultipartUpload") == rule.hits
    assert _leftovers(server, backend) == []


@pytest.mark.parametrize("server", ["moto_s3", "seaweed_s3"], indirect=True)  # botocore's retries are settable
@pytest.mark.parametrize("kind", ["500", "cut"])
def test_a_part_failing_after_retries_aborts_the_upload_and_commits_nothing(faulty, server, kind):
    """The upload is aborted once its other parts settled (no upload left open on the server), the
    save raises naming the step's object (a 500: :class:`PayloadUploadError` naming the request; a
    connection cut every time: :class:`StoreUnreachableError` naming the endpoint), step 2 has no
    object at all, step 1 is untouched."""
    backend, proxy = faulty
    retries = {"retries": {"total_max_attempts": 2, "mode": "standard"}}
    store = open_store(through_proxy(backend, proxy, config_kwargs=retries, retries=1))
    save(store, 1, {"prev.bin": SMALL})
    rule = _second_part_rule(proxy, backend, times=None, **UPLOAD_FAULTS[kind])
    with pytest.raises(OSError) as caught:
        save(store, 2, {"model.bin": TWO_PARTS, "small.bin": SMALL})
    message = str(caught.value)
    assert f"{backend.url}/step-000002/attempt-" in message
    if kind == "500":
        assert type(caught.value) is PayloadUploadError and "/model.bin: UploadPart 2 failed" in message
    else:
        assert type(caught.value) is StoreUnreachableError
        assert (f"/model.bin: cannot write payload 'model.bin' of step 2: endpoint {proxy.endpoint_url} closed "
                "the connection") in message and message.endswith("; step 2 is not committed")
    # A 500: the request and its one retry. A cut connection is retried by the client's handling of
    # connection errors as well (4 requests on this stack): a bounded few.
    assert rule.hits == 2 if kind == "500" else 2 <= rule.hits <= 8
    assert proxy.count("AbortMultipartUpload") == 1 and proxy.count("CompleteMultipartUpload") == 0
    assert _leftovers(server, backend) == []
    assert stored_keys(backend, "step-000002/") == []
    assert store.steps() == [1] and store.read(1, "prev.bin") == SMALL


@pytest.mark.parametrize("server", ["fake_gcs"], indirect=True)
@pytest.mark.parametrize(("status", "code", "attempts"), [(400, "badRequest", 1), (503, "backendError", 6)])
def test_a_gcs_part_failing_deletes_every_temporary_object_and_commits_nothing(faulty, server, gcsfs_backoff,
                                                                               status, code, attempts):
    """A part upload refused with a status gcsfs does not retry (400: one attempt) or answered 503 on
    every attempt (gcsfs makes 6; its backoff, about 30 s in all, is recorded instead of slept):
    the save raises :class:`PayloadUploadError` naming the payload and the part's request;
    every temporary part object (those uploaded before, beside and after it) is deleted once the
    parts in flight settled, no compose is sent, step 2 has no object at all, step 1 is untouched."""
    waits = gcsfs_backoff
    backend, proxy = faulty
    store = open_store(backend)
    save(store, 1, {"prev.bin": SMALL})
    rule = _second_part_rule(proxy, backend, times=None, fault="status", status=status, code=code)
    with pytest.raises(PayloadUploadError) as caught:
        save(store, 2, {"model.bin": LARGE, "small.bin": SMALL})
    message = str(caught.value)
    assert f"{backend.url}/step-000002/attempt-" in message and "/model.bin: upload of part 2 (model.bin.part-" in message
    assert rule.hits == attempts and len(waits) == attempts - 1
    if attempts > 1:
        assert 31 <= sum(waits) <= 36  # 1+2+4+8+16 s, plus jitter < 1 s each
    assert len(_parts(proxy, backend, "model.bin")) >= 1  # parts before it landed, then were deleted
    assert proxy.count("Compose") == 0 and proxy.count("DeleteObject") >= 1
    assert _leftovers(server, backend) == []
    assert stored_keys(backend, "step-000002/") == []
    assert store.steps() == [1] and store.read(1, "prev.bin") == SMALL


@pytest.mark.parametrize("server", ["moto_s3", "fake_gcs"], indirect=True)
@pytest.mark.parametrize("stalls", [1, None], ids=["once", "every-time"])
def test_an_endpoint_that_stops_reading_a_body_fails_the_attempt_within_the_read_timeout(faulty, server,
                                                                                        gcsfs_backoff, stalls):
    """An endpoint that takes a request's headers and never reads its body (a peer whose receive
    window stays shut): aiohttp's read timeout starts only once a body is sent, so each attempt is
    bounded by the body's send timeout (``read_timeout_secs``) once the socket buffers are full.
    Every time: 0.5 s, so the attempts fail fast. Once: 2 s, because the same timeout also bounds
    the wait for the server's answer to the good attempt, and a server on a loaded 2-core machine
    took more than 0.5 s to take in 24 MiB (the test failed under load). The payload (24 MiB, one request under a 32 MiB part) is larger than the socket
    buffers on loopback (4 MiB sent at most).

    Once: the next attempt sends the whole body again and the step commits bit-exact. On S3 that
    attempt is s3fs's second pass (botocore makes one attempt here), which reuses the body as the
    failed attempt left it, half read. Every time: the save raises :class:`StoreUnreachableError`
    naming the payload, the endpoint and the timeout after the client's attempts (botocore: 1 in
    each of s3fs's 2 passes; gcsfs: 6, its backoff recorded), nothing is committed and step 1 is
    untouched."""
    backend, proxy = faulty
    payload = _data(24 << 20)
    store = open_store(through_proxy(backend, proxy, part_size_bytes=32 << 20,
                                     read_timeout_secs=0.5 if stalls is None else 2.0,
                                     config_kwargs={"retries": {"total_max_attempts": 1}}))
    save(store, 1, {"prev.bin": SMALL})
    dialect = dialect_of(backend)
    rule = proxy.add(fault="stall_body", times=stalls, match=lambda r: dialect.names(r, "model.bin"))
    if stalls == 1:
        save(store, 2, {"model.bin": payload})
        assert rule.hits == 1 and [r.request_bytes for r in proxy.requests
                                   if r.fault is None and dialect.names(r, "model.bin")] == [len(payload)]
        assert store.steps() == [1, 2] and store.read(2, "model.bin") == payload
        return
    with pytest.raises(StoreUnreachableError) as caught:
        save(store, 2, {"model.bin": payload})
    proxy.clear()
    message = str(caught.value)
    assert f"{backend.url}/step-000002/attempt-" in message and "/model.bin: " in message
    assert f"endpoint {proxy.endpoint_url} did not answer within 0.5 s" in message
    assert rule.hits == (6 if dialect is GCS else 2)
    assert len(gcsfs_backoff) == (5 if dialect is GCS else 0)
    assert stored_keys(backend, "step-000002/") == []
    assert store.steps() == [1] and store.read(1, "prev.bin") == SMALL


# -- ranged reads ---------------------------------------------------------------------------------
def _committed_large(faulty):
    """A store whose step 2 holds ``model.bin`` (:data:`TWO_PARTS`); the proxy's record cleared."""
    backend, proxy = faulty
    store = open_store(backend)
    save(store, 2, {"model.bin": TWO_PARTS})
    proxy.clear()
    return store


def _model_gets(proxy, backend) -> list:
    dialect = dialect_of(backend)
    return [r for r in proxy.requests if r.op == dialect.get_op and dialect.names(r, "model.bin")]


def _range_rule(proxy, backend, start: int, **fault):
    """Fault the first ranged GET of ``model.bin`` that starts at byte ``start``."""
    prefix = f"bytes={start}-"
    dialect = dialect_of(backend)
    return proxy.add(ops=(dialect.get_op,), times=1, **fault,
                     match=lambda r: dialect.names(r, "model.bin") and r.headers.get("range", "").startswith(prefix))


# One committed payload serves every ranged-read case of a server (each case reads it through a
# fresh store, the proxy's rules and record cleared): the upload is made once, not per case.
def _read_in_parallel_ranges(store, backend, proxy) -> None:
    assert store.read(2, "model.bin") == TWO_PARTS
    gets = _model_gets(proxy, backend)
    ranges = sorted(r.headers["range"] for r in gets)
    assert ranges == sorted(f"bytes={s}-{min(len(TWO_PARTS), s + PART) - 1}" for s in range(0, len(TWO_PARTS), PART))
    assert sum(r.response_bytes for r in gets) == len(TWO_PARTS)
    assert proxy.count(dialect_of(backend).stat_op) == 0  # planned from the manifest's size


def _short_or_altered_range_is_an_integrity_error_naming_the_object(store, backend, proxy, kind: str) -> None:
    rule = _range_rule(proxy, backend, PART, fault=kind)
    with pytest.raises(IntegrityError) as caught:
        store.read(2, "model.bin")
    assert rule.hits == 1
    message = str(caught.value)
    assert "step-000002/" in message and "model.bin" in message
    if kind == "short":
        assert f"bytes {PART}-{len(TWO_PARTS) - 1} returned {(len(TWO_PARTS) - PART) // 2} bytes" in message
    assert store.read(2, "model.bin") == TWO_PARTS  # the object itself is whole


def _range_cut_or_throttled_is_read_again(store, backend, proxy, kind: str) -> None:
    rule = _range_rule(proxy, backend, 0, **(dict(fault="truncate") if kind == "truncate" else UPLOAD_FAULTS["slowdown"]))
    assert store.read(2, "model.bin") == TWO_PARTS
    assert rule.hits == 1
    assert len(_model_gets(proxy, backend)) == -(-len(TWO_PARTS) // PART) + 1  # every range once, the faulted one twice


def test_ranged_reads_in_parallel_and_their_faults(faulty):
    """A payload is read in parallel ranges planned from the manifest; a short or altered range is an
    :class:`IntegrityError` naming the object (which stays whole); a range cut or throttled is read
    again. Each case on a fresh store over the same committed step, the proxy cleared before it."""
    backend, proxy = faulty
    _committed_large(faulty)
    cases = [("parallel", _read_in_parallel_ranges, {})]
    cases += [(kind, _short_or_altered_range_is_an_integrity_error_naming_the_object, {"kind": kind})
              for kind in ("short", "corrupt")]
    cases += [(kind, _range_cut_or_throttled_is_read_again, {"kind": kind}) for kind in ("truncate", "slowdown")]
    for name, check, kwargs in cases:
        proxy.clear()
        try:
            check(open_store(backend), backend, proxy, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc


def test_an_object_of_another_size_is_an_integrity_error_with_its_real_size(faulty):
    """The ranges are planned from the manifest's size; an object replaced behind the store's back
    (longer, shorter, empty: one after the other, each read through a fresh store) is reported
    with its real size."""
    backend = faulty[0]
    _committed_large(faulty)
    (rel,) = [k for k in stored_keys(backend, "step-000002/") if k.endswith("/model.bin")]
    for size_bytes in (PART + 1, 3 * PART, 0):
        raw_put(raw_backend(backend), rel, _data(size_bytes))
        with pytest.raises(IntegrityError) as caught:
            open_store(backend).read(2, "model.bin")
        message = str(caught.value)
        assert f"has {size_bytes} bytes, manifest says {len(TWO_PARTS)}" in message, size_bytes
        assert f"payload 'model.bin' at {backend.url}/step-000002/attempt-" in message, size_bytes


# -- GCS: the compose tree ------------------------------------------------------------------------
def test_compose_groups_make_a_tree_of_at_most_32_sources_in_byte_order():
    from opd_store.storage.gcs._composite import compose_groups

    names = [f"p{i:05d}" for i in range(1, 1090)]  # 1,089 parts: 35 groups, then 2, then 1
    levels = compose_groups(names)
    assert [len(level) for level in levels] == [35, 2, 1]
    assert all(len(group) <= 32 for level in levels for group in level)
    assert [name for group in levels[0] for name in group] == names  # every part once, in order
    assert levels[1] == [[f"0:{i}" for i in range(32)], [f"0:{i}" for i in range(32, 35)]]
    assert levels[2] == [["1:0", "1:1"]]
    assert compose_groups(["only"]) == [[["only"]]]
    assert compose_groups(names[:32]) == [[names[:32]]]


@pytest.mark.parametrize("server", ["fake_gcs"], indirect=True)
def test_a_gcs_payload_of_more_parts_than_one_compose_takes_is_composed_as_a_tree(faulty, server, monkeypatch):
    """With a fan-in of 2 (GCS's is 32: the same code path, 4 parts instead of 33), the 4 parts of
    ``model.bin`` become 2 intermediate composites, then the payload; every temporary object is
    deleted before the manifest is created."""
    import opd_store.storage.gcs._composite as gcs_transfers

    monkeypatch.setattr(gcs_transfers, "MAX_COMPOSE_SOURCES", 2)
    backend, proxy = faulty
    store = open_store(backend)
    save(store, 2, {"model.bin": LARGE})
    composes = [r for r in proxy.requests if r.op == "Compose"]
    targets = sorted(GCS.object_of(r).rpartition("/")[2] + (PART_MARKER if PART_MARKER in r.path else "")
                     for r in composes)
    assert targets == ["model.bin", "model.bin.part-", "model.bin.part-"]
    deletes = [i for i, r in enumerate(proxy.requests) if r.op == "DeleteObject"]
    assert len(deletes) == 4 + 2  # the parts and the intermediate composites
    manifest = next(i for i, r in enumerate(proxy.requests) if r.op == GCS.create_op)
    assert manifest > max(deletes)
    assert _leftovers(server, backend) == []
    assert store.read(2, "model.bin") == LARGE


# -- sizes around a part --------------------------------------------------------------------------
SIZES = {"empty.bin": 0, "one.bin": 1, "under.bin": PART - 1, "part.bin": PART, "over.bin": PART + 1,
         "three.bin": 3 * PART + 1}


def test_payloads_around_the_part_size_round_trip_bit_exact_in_the_fewest_requests(faulty):
    """A payload of at most one part (0, 1, part - 1, part bytes) is one upload request and no
    assembly; part + 1 is 2 parts, 3 parts + 1 is 4, each assembled once (and on GCS its
    temporary objects deleted); every read is one ranged GET per part and nothing else."""
    backend, proxy = faulty
    dialect = dialect_of(backend)
    store = open_store(backend)
    payloads = {name: _data(size, salt=size % 7) for name, size in SIZES.items()}
    save(store, 3, payloads)
    for name, size in SIZES.items():
        parts = -(-size // PART)
        mine = [r.op for r in proxy.requests if dialect.names(r, name)]
        if parts <= 1:
            single = "MediaUpload" if dialect is GCS else "PutObject"
            assert mine == [single], (name, mine)
        else:
            assert mine.count(dialect.part_op) == parts and mine.count(dialect.assemble_op) == 1, (name, mine)
            assert mine.count("DeleteObject") == (parts if dialect is GCS else 0), (name, mine)
    proxy.clear()
    for name, data in payloads.items():
        assert store.read(3, name) == data, name
        gets = [r for r in proxy.requests if r.op == dialect.get_op and dialect.names(r, name)]
        assert len(gets) == -(-len(data) // PART), name
    assert _leftovers_of(backend) == []


def _leftovers_of(backend) -> list[str]:
    return [key for key in stored_keys(backend) if PART_MARKER in key]


@pytest.mark.parametrize("server_name", ["seaweed_s3"])  # the client's headers; SeaweedFS checks signatures
def test_s3_bodies_go_unsigned_with_a_signed_checksum_header_unless_the_caller_signs(server_name, request):
    """Over plain HTTP botocore would SHA-256 every body (the client's CPU in a save): opd_store's S3
    clients send ``UNSIGNED-PAYLOAD`` as botocore does over HTTPS, and each body still carries a
    checksum header the server checks; a caller who wants body signing gets it."""
    import hashlib

    server = request.getfixturevalue(server_name)
    backend = server.new_backend()
    proxy = dialect_of(backend).fault_proxy(server.endpoint_url)
    try:
        store = open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=3))
        save(store, 1, {"model.bin": LARGE, "small.bin": SMALL})
        bodies = [r for r in proxy.requests if r.op in ("UploadPart", "PutObject")]
        assert sorted(r.request_bytes for r in bodies if r.op == "UploadPart") == [PART // 2, PART, PART, PART]
        assert len([r for r in bodies if r.op == "PutObject"]) == 2  # small.bin, then the manifest
        for sent in bodies:
            assert sent.headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
            checksums = [name for name in sent.headers if name.startswith("x-amz-checksum-")]
            assert checksums and all(name in sent.headers["authorization"] for name in checksums)
        # Payload bodies carry opd_store's own CRC32C of the bytes sent (the manifest's gets botocore's).
        parts = sorted((r for r in bodies if r.op == "UploadPart"), key=dialect_of(backend).part_number)
        assert [r.headers["x-amz-checksum-crc32c"] for r in parts] == [
            crc32c_base64(LARGE[i:i + PART]) for i in range(0, len(LARGE), PART)]
        assert [r.headers.get("x-amz-checksum-crc32c") for r in bodies if r.op == "PutObject"][0] == crc32c_base64(SMALL)
        create = [r for r in proxy.requests if r.op == "CreateMultipartUpload"]
        assert [r.headers["x-amz-checksum-algorithm"] for r in create] == ["CRC32C"]
        assert store.read(1, "model.bin") == LARGE and store.read(1, "small.bin") == SMALL

        proxy.requests.clear()
        signing = open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=3,
                                           config_kwargs={"s3": {"payload_signing_enabled": True}}))
        save(signing, 2, {"model.bin": LARGE})
        parts = sorted((r for r in proxy.requests if r.op == "UploadPart"), key=dialect_of(backend).part_number)
        expected = [hashlib.sha256(LARGE[i:i + PART]).hexdigest() for i in range(0, len(LARGE), PART)]
        assert [r.headers["x-amz-content-sha256"] for r in parts] == expected
        assert signing.read(2, "model.bin") == LARGE
    finally:
        proxy.stop()


@pytest.mark.parametrize("server", ["seaweed_s3"], indirect=True)  # moto checks no checksum (docs/protocol.md)
def test_a_part_altered_on_the_way_is_refused_by_its_crc32c_then_sent_again(faulty, server):
    """Each part carries the CRC32C of its buffer: the server refuses a part whose bytes were altered
    on the way in (``BadDigest``), the client sends it again, and the payload lands bit-exact."""
    backend, proxy = faulty
    store = open_store(backend)
    rule = _second_part_rule(proxy, backend, fault="corrupt_request")
    save(store, 2, {"model.bin": TWO_PARTS})
    assert rule.hits == 1
    second = [r for r in proxy.requests if r.op == "UploadPart" and dialect_of(backend).part_number(r) == 2]
    assert [(r.fault, r.status) for r in second] == [("corrupt_request", 400), (None, 200)]
    assert store.read(2, "model.bin") == TWO_PARTS and _leftovers(server, backend) == []


@pytest.mark.parametrize("server", ["seaweed_s3"], indirect=True)
def test_a_part_altered_every_time_aborts_the_upload_and_commits_nothing(faulty, server):
    """Altered on every attempt (the client's 3): the upload is aborted, the save raises naming the
    request and the server's refusal, and the step is not committed."""
    backend, proxy = faulty
    store = open_store(backend)
    save(store, 1, {"prev.bin": SMALL})
    rule = _second_part_rule(proxy, backend, fault="corrupt_request", times=None)
    with pytest.raises(PayloadUploadError, match="/model.bin: UploadPart 2 failed") as caught:
        save(store, 2, {"model.bin": TWO_PARTS, "small.bin": SMALL})
    assert "did not match what we received" in str(caught.value)  # the server's BadDigest, as s3fs words it
    assert f"{backend.url}/step-000002/attempt-" in str(caught.value)
    assert rule.hits == 3
    assert proxy.count("AbortMultipartUpload") == 1 and proxy.count("CompleteMultipartUpload") == 0
    assert _leftovers(server, backend) == [] and stored_keys(backend, "step-000002/") == []
    assert store.steps() == [1] and store.read(1, "prev.bin") == SMALL


def test_a_part_buffer_whose_views_outlive_a_request_is_reused_as_it_is(s3_backend):
    """A failed request can leave views of its part buffer alive (in a traceback) until the garbage
    collector runs, and a ``bytearray`` with live views cannot be resized: the writer never resizes
    a buffer (a last part goes up as a view of its bytes), so the next save reuses it."""
    import dataclasses

    store = open_store(dataclasses.replace(s3_backend, storage_options=dict(
        s3_backend.storage_options, part_size_bytes=PART, parts_in_flight=2)))
    pool = store.storage.transfers.part_pool
    buffers = [pool.acquire() for _ in range(2)]
    lingering = [memoryview(buffer)[:10] for buffer in buffers]  # what a failed request's traceback keeps
    for buffer in buffers:
        pool.release(buffer, was_flying=False)
    save(store, 1, {"small.bin": SMALL, "model.bin": LARGE})  # tails of both payloads from those buffers
    assert store.read(1, "small.bin") == SMALL and store.read(1, "model.bin") == LARGE
    assert pool.stats()["allocated"] == 2 and all(view.nbytes == 10 for view in lingering)


@pytest.mark.parametrize("server_name", ["seaweed_s3"])  # the client's headers, on the server that checks them
def test_a_client_set_to_send_checksums_only_when_required_sends_none(server_name, request):
    """``request_checksum_calculation=when_required`` (botocore's setting, also
    ``AWS_REQUEST_CHECKSUM_CALCULATION``; what S3-compatible servers that refuse checksum headers
    ask for): opd_store's parts carry no checksum either, and the payload commits bit-exact."""
    server = request.getfixturevalue(server_name)
    backend = server.new_backend()
    proxy = dialect_of(backend).fault_proxy(server.endpoint_url)
    try:
        store = open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=3,
                                         config_kwargs={"request_checksum_calculation": "when_required"}))
        save(store, 1, {"model.bin": LARGE, "small.bin": SMALL})
        sent = [r for r in proxy.requests if r.op in ("CreateMultipartUpload", "UploadPart", "PutObject")]
        assert len(sent) == 1 + 4 + 2
        assert not [name for r in sent for name in r.headers if name.startswith("x-amz-checksum-")]
        assert store.read(1, "model.bin") == LARGE and store.read(1, "small.bin") == SMALL
    finally:
        proxy.stop()
