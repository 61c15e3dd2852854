"""Shared fixtures: one moto S3 server, one SeaweedFS and one fake-gcs-server per test process, on
loopback (each started when a test first asks for it).

Under pytest-xdist every worker is its own process, so "per session" means per worker: each worker
has its own servers (ports chosen by the OS), its own temporary directories (``tmp_path`` lives under
a per-worker base) and its own fork server. ``backend`` is parametrised over local, memory, s3
(moto) and gcs; a test that names ``seaweed`` in its parameters also runs on S3 served by
SeaweedFS. Each test gets a clean location (moto reset and a fresh bucket, a new SeaweedFS or GCS
bucket, a cleared ``memory://``, a new temp directory). The helpers live in :mod:`opd_testkit`.
"""

from __future__ import annotations

import collections
import gc
import os
import re
import sys
import types
from pathlib import Path

import pytest
from opd_testkit.stores import LOOPBACK_CA_BUNDLE, Backend, clear_memory_fs, use_emulator_environment, with_session
from opd_testkit.stores import aio_session as shared_aio_session

sys.path.insert(0, str(Path(__file__).parent))  # tests/ helpers: faults, proc_writer, store_fixtures

from store_fixtures import backend_named  # noqa: E402

use_emulator_environment()  # before anything imports gcsfs or botocore
# Every endpoint a test reaches is plain HTTP on loopback: a one-certificate bundle even where the
# machine sets its own (each S3 client parses its bundle: ~35 CPU-ms for a system bundle, for nothing).
os.environ["AWS_CA_BUNDLE"] = LOOPBACK_CA_BUNDLE

# Bytecode caches on, for this process and every process the suite starts (xdist workers, fork
# servers, ranks, CLI runs): with PYTHONDONTWRITEBYTECODE=1 in the environment (some images set it)
# each of them compiles opd_store again and pytest rewrites every test module again in each worker:
# about 5 CPU-s per worker and 0.5 CPU-s per new interpreter on the 2-core machine (docs/testing.md).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ALL_BACKENDS = ("local", "memory", "s3", "gcs")

_DURATIONS = Path(__file__).with_name("DURATIONS.md")
_PHASE = re.compile(r"^\s*(?P<secs>\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+(?P<nodeid>\S+)\s*$")


def recorded_secs(report: Path = _DURATIONS) -> dict[str, float]:
    """Seconds per test id (setup + call + teardown) from the slowest-phases table of the committed
    durations report (scripts/durations.py writes it; phases under its threshold are absent)."""
    secs: dict[str, float] = collections.defaultdict(float)
    if report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            phase = _PHASE.match(line)
            if phase:
                secs[phase["nodeid"]] += float(phase["secs"])
    return secs


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error under -p no:xdist
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, plus one. About a fifth of a worker's time is spent waiting
    (on a server, a child process, a timeout the test is about), and a third worker fills those
    waits: measured on the 2-core machine, 3 workers ran the suite in 362 s against 392 s for 2
    (docs/testing.md)."""
    return len(os.sched_getaffinity(0)) + 1


def _require_groups(config, items) -> None:
    """Refuse to run when ``--dist loadgroup`` would not keep an ``xdist_group`` on one worker.

    pytest-xdist groups a test by appending ``@<group>`` to its node id (its worker-side
    ``pytest_collection_modifyitems``, which runs before this conftest's); pytest 9.2 computes node
    ids from another attribute, so the suffix is lost, every group is spread over the workers and
    each worker builds the group's module fixture again (the IAM recording three times: +40 s).
    :func:`pytest_configure` refuses such a pytest on the controller, with a readable message; this
    check (in each worker) catches any other way the grouping is lost.

    Raises:
        pytest.UsageError: a grouped test whose node id carries no group.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(f"pytest-xdist's loadgroup did not group {item.nodeid} (pytest "
                                    f"{pytest.__version__}; pyproject.toml pins the versions that work)")


def pytest_configure(config) -> None:
    """Refuse pytest >= 9.2 with ``--dist loadgroup`` (see :func:`_require_groups`); on the
    controller of a pytest-xdist run, start the fork server its workers share.

    Raises:
        pytest.UsageError: naming the installed pytest and the fix.
    """
    from packaging.version import Version

    if getattr(config.option, "dist", "no") == "loadgroup" and Version(pytest.__version__) >= Version("9.2"):
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks pytest-xdist's loadgroup (every xdist_group "
                                "would be built on every worker): install the test extra's pytest<9.2 "
                                "(bash scripts/setup.sh)")
    _share_fork_server(config)


def _share_fork_server(config) -> None:
    """One fork server for every worker of the run, started here on the controller before the
    workers are (they inherit :data:`~opd_testkit.forkserver.SHARED_SOCKET_ENV`), and stopped
    when the run ends (with every child still running). Its preload (torch, transformers, peft, the
    trainers: about 8 CPU-s) is then paid once, not once per worker; the controller waits only for
    its socket, and a worker's first request waits for the preload. Without workers (``-n 0``, a
    worker itself, ``--collect-only``) each process starts its own on first use."""
    from opd_testkit.forkserver import SHARED_SOCKET_ENV, ForkServer, accepts_connections

    if (hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
            or config.option.collectonly or accepts_connections(os.environ.get(SHARED_SOCKET_ENV) or "")):
        return  # no workers, or a live server already named (a run inside a run): use it
    server = ForkServer(wait_ready=False)
    os.environ[SHARED_SOCKET_ENV] = server.socket_path

    def stop() -> None:
        os.environ.pop(SHARED_SOCKET_ENV, None)
        server.close()

    config.add_cleanup(stop)


def pytest_collection_modifyitems(config, items) -> None:
    """Run the longest tests first: xdist hands out work one test at a time as workers free up, so
    a 40-second test collected last keeps one core busy while the other idles at the end of the
    run (longest-processing-time-first scheduling). The order is the recorded durations, heaviest
    first, then collection order; it is the same in every worker, as xdist requires."""
    _require_groups(config, items)
    secs = recorded_secs()
    items.sort(key=lambda item: -secs.get(item.nodeid, 0.0))


@pytest.fixture(scope="session")
def moto_s3():
    from opd_testkit.s3 import MotoS3

    server = MotoS3()
    # Before any S3 test runs, prove s3fs works against this server over HTTP (list, write, read,
    # multipart, delete); a failure stops every S3 test with its reason.
    server.smoke_check()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_s3():
    """This worker's SeaweedFS (``weed mini``, a production S3 server in Go) on loopback."""
    from opd_testkit.seaweed import SeaweedS3

    server = SeaweedS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fake_gcs():
    from opd_testkit.gcs import FakeGCS

    server = FakeGCS()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fork_server():
    """The preloaded fork server of this worker (:mod:`opd_testkit.forkserver`; under
    pytest-xdist the one the run's workers share)."""
    from opd_testkit.forkserver import default_server

    return default_server()


@pytest.fixture(autouse=True)
def _clean_memory_fs():
    clear_memory_fs()
    yield
    clear_memory_fs()


@pytest.fixture
def gc_of_this_test():
    """``gc.collect()`` inside the test scans only the objects made since this fixture ran: the
    session's older objects (torch, transformers, the servers' clients: ~250k of them) are frozen
    (:func:`gc.freeze`) for the test's duration and unfrozen after it. A collect then takes
    milliseconds instead of 0.1-0.8 s, and still collects every cycle the test made (an object
    made later can only be kept alive by a live reference, frozen or not)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def make_backend(name: str, request, tmp_path: Path) -> Backend:
    if name == "local":
        return Backend("local", str(tmp_path / "store"), {})
    if name == "memory":
        return Backend("memory", "memory://opd-test/runs/demo", {})
    if name == "s3":
        return request.getfixturevalue("moto_s3").new_backend()
    if name == "gcs":
        return request.getfixturevalue("fake_gcs").new_backend()
    if name == "seaweed":
        return request.getfixturevalue("seaweed_s3").new_backend()
    raise ValueError(name)


@pytest.fixture(params=ALL_BACKENDS)
def backend(request, tmp_path) -> Backend:
    """A clean store location on each of local, memory, S3 (moto server) and GCS (fake-gcs-server)."""
    return make_backend(request.param, request, tmp_path)


@pytest.fixture
def s3_backend(request, tmp_path) -> Backend:
    return make_backend("s3", request, tmp_path)


@pytest.fixture
def seaweed_backend(request, tmp_path) -> Backend:
    """A clean S3 location on SeaweedFS (a new bucket)."""
    return make_backend("seaweed", request, tmp_path)


@pytest.fixture
def gcs_backend(request, tmp_path) -> Backend:
    return make_backend("gcs", request, tmp_path)


@pytest.fixture
def local_backend(request, tmp_path) -> Backend:
    return make_backend("local", request, tmp_path)


# -- shared by the OPD, spot, retention and CLI tests ---------------------------------------------


@pytest.fixture(scope="session")
def aio_session():
    """The process's aiobotocore session (:func:`opd_testkit.stores.aio_session`)."""
    return shared_aio_session()


@pytest.fixture
def opd_s3_backend(s3_backend, aio_session) -> Backend:
    """A clean S3 (moto server) location whose stores share :func:`aio_session`."""
    return with_session(s3_backend)


@pytest.fixture
def opd():
    """Helpers for OPD tests: the small real objects of :mod:`opd_testkit.opd` and
    ``backend_named(request, name)``."""
    from opd_testkit import opd as objects

    return types.SimpleNamespace(
        backend_named=backend_named,
        TinyConfig=objects.TinyConfig,
        StubAdapterModel=objects.StubAdapterModel,
        make_training=objects.make_training,
        trainer_state=objects.trainer_state,
        save_kwargs=objects.save_kwargs,
        load_kwargs=objects.load_kwargs,
        rng_fingerprint=objects.rng_fingerprint,
        next_draws=objects.next_draws,
        seed_all=objects.seed_all,
        assert_same=objects.assert_same,
        PROVENANCE=objects.PROVENANCE,
    )


@pytest.fixture(scope="session")
def peft_factory():
    """A tiny real PEFT LoRA student and tokenizer (:class:`opd_testkit.opd.PeftFactory`)."""
    from opd_testkit.opd import PeftFactory

    return PeftFactory()


@pytest.fixture
def s3_fault_proxy(moto_s3, aio_session):
    """A clean S3 bucket behind :class:`~opd_testkit.proxies.S3FaultProxy`; yields
    (Backend through the proxy, proxy)."""
    from opd_testkit.proxies import S3FaultProxy, through_proxy

    proxy = S3FaultProxy(moto_s3.endpoint_url)
    try:
        yield through_proxy(moto_s3.new_backend(), proxy, session=aio_session), proxy
    finally:
        proxy.stop()
