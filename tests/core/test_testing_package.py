"""``opd_store.testing`` as a user meets it: a third-party ``Storage`` runs the conformance suite
and passes, a broken one fails the check that names its fault, the fault wrapper passes the suite
itself, and the package imports without pytest."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from opd_testkit import forkserver

from opd_store import CheckpointStore
from opd_store.storage import LocalStorage, Storage, open_storage
from opd_store.testing import Fault, FaultyStorage, FaultyWriter, RawBackend, StorageConformance


class DictWriter:
    """A payload writer of :class:`DictStorage`: the object appears when it is closed."""

    def __init__(self, objects: dict, rel: str) -> None:
        self.objects, self.rel, self.chunks, self.closed = objects, rel, [], False

    def write(self, data) -> int:
        self.chunks.append(bytes(data))
        return len(self.chunks[-1])

    def close(self) -> None:
        if not self.closed:
            self.objects[self.rel] = (b"".join(self.chunks), time.time())
            self.closed = True

    def discard(self) -> None:
        self.chunks.clear()


class DictStorage(Storage):
    """A tiny third-party storage: objects in a dict ``{rel: (bytes, modified_secs)}``."""

    commit_primitive = "membership check and insert under a lock"
    atomic_create = True

    def __init__(self, objects: dict) -> None:
        super().__init__(objects, "/dict-store", "dict://dict-store")
        self.objects = objects
        self.lock = threading.Lock()

    def _under(self, rel: str) -> dict[str, tuple[bytes, float]]:
        prefix = f"{rel}/" if rel else ""
        return {key[len(prefix):]: value for key, value in self.objects.items() if key.startswith(prefix)}

    def list_children(self, rel=""):
        below = self._under(rel)
        dirs = sorted({name.split("/", 1)[0] for name in below if "/" in name})
        return dirs, {name: len(data) for name, (data, _) in below.items() if "/" not in name}

    def list_tree(self, rel=""):
        return {name: len(data) for name, (data, _) in self._under(rel).items()}

    def list_tree_modified(self, rel=""):
        return {name: (len(data), modified) for name, (data, modified) in self._under(rel).items()}

    def size(self, rel):
        found = self.objects.get(rel)
        return None if found is None else len(found[0])

    def read_bytes(self, rel, *, small=False, max_bytes=None):
        if rel not in self.objects:
            raise FileNotFoundError(self.url(rel))
        data = self.objects[rel][0]
        return data if max_bytes is None else data[:max_bytes + 1]

    def open_write(self, rel):
        return DictWriter(self.objects, rel)

    def create_exclusive(self, rel, data):
        with self.lock:
            if rel in self.objects:
                raise FileExistsError(self.url(rel))
            self.objects[rel] = (bytes(data), time.time())

    def delete(self, rel):
        self.objects.pop(rel, None)

    def delete_tree(self, rel):
        for key in [key for key in self.objects if key.startswith(f"{rel}/")]:
            del self.objects[key]



class DictRaw(RawBackend):
    """The dict itself, read and written without :class:`DictStorage`."""

    def __init__(self, objects: dict) -> None:
        self.objects = objects

    def put(self, rel, data):
        self.objects[rel] = (bytes(data), time.time())

    def cat(self, rel):
        return self.objects[rel][0]

    def rm(self, rel):
        del self.objects[rel]

    def keys(self):
        return {rel: len(data) for rel, (data, _) in self.objects.items()}


class TestDictStorage(StorageConformance):
    """The suite as a third party runs it: two fixtures, and pytest collects every check."""

    @pytest.fixture
    def objects(self) -> dict:
        return {}

    @pytest.fixture
    def storage(self, objects) -> Storage:
        return DictStorage(objects)

    @pytest.fixture
    def raw(self, objects) -> RawBackend:
        return DictRaw(objects)


class StaleListings(DictStorage):
    """Answers each listing and size from a cache (the s3fs bug the freshness rule prevents)."""

    def __init__(self, objects: dict) -> None:
        super().__init__(objects)
        self.cache: dict = {}

    def list_tree(self, rel=""):
        return self.cache.setdefault(("list", rel), super().list_tree(rel))

    def size(self, rel):
        return self.cache.setdefault(("size", rel), super().size(rel))


class OverwritingCreate(DictStorage):
    """A manifest create that overwrites: two writers of one step could both commit."""

    def create_exclusive(self, rel, data):
        self.objects[rel] = (bytes(data), time.time())


CHECKS = sorted(name for name in dir(StorageConformance) if name.startswith("test_"))


def failed_checks(storage_class: type[DictStorage]) -> dict[str, str]:
    """Run every check of the suite on fresh locations of ``storage_class``; return
    ``{check: failure message}`` of the checks that failed."""
    failures = {}
    for name in CHECKS:
        objects: dict = {}
        try:
            getattr(StorageConformance(), name)(storage_class(objects), DictRaw(objects))
        except (AssertionError, pytest.fail.Exception) as exc:
            failures[name] = str(exc)
    return failures


@pytest.mark.parametrize(("storage_class", "check", "shown"), [
    (StaleListings, "test_listings_and_sizes_are_fresh", "{} == {'x.bin': 3}"),
    (OverwritingCreate, "test_create_exclusive_is_create_only", "DID NOT RAISE"),
])
def test_a_broken_storage_fails_the_check_of_its_fault(storage_class, check, shown):
    assert len(CHECKS) == 10
    failures = failed_checks(storage_class)
    assert list(failures) == [check]
    assert shown in failures[check]  # the suite's asserts are rewritten: the values are shown


def test_the_sound_storage_fails_no_check():
    assert failed_checks(DictStorage) == {}


class TestFaultyStorageOverLocal(StorageConformance):
    """The wrapper answers every verb as the storage it wraps does."""

    @pytest.fixture
    def storage(self, tmp_path) -> Storage:
        return FaultyStorage(open_storage(str(tmp_path / "store")))

    @pytest.fixture
    def raw(self, tmp_path) -> RawBackend:
        from .helpers import Raw
        from opd_testkit.stores import Backend

        return Raw(Backend("local", str(tmp_path / "store"), {}))


def test_the_wrapper_is_the_wrapped_storage_plus_a_record(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"))
    inner = store.storage
    spy = FaultyStorage(inner, Fault(when=lambda op: op.kind == "create"))
    assert isinstance(spy, Storage) and isinstance(inner, LocalStorage)
    # The wrapped backend's settings, not Storage's defaults (8 MiB slices, its own pools).
    assert (spy.write_slice_bytes, spy.transfers, spy.transfers.part_pool, spy.commit_primitive) == (
        512 << 10, inner.transfers, inner.transfers.part_pool, inner.commit_primitive)
    assert isinstance(spy.open_write("x.bin"), FaultyWriter)
    with pytest.raises(OSError, match="step 1 is not committed"):
        with CheckpointStore.from_storage(spy).begin(1) as txn:
            txn.write_bytes("model.bin", b"weights")
    assert [op.kind for op in spy.mutating_ops] == ["write", "close", "sync", "create"]
    assert [op.failed for op in spy.mutating_ops] == [False, False, False, True]
    assert store.steps() == [] and store.status(1) == "uncommitted"


def test_the_package_imports_without_pytest():
    code = (
        "import sys\n"
        "for name in [n for n in sys.modules if n.startswith(('opd_store.testing', 'pytest', '_pytest'))]:\n"
        "    del sys.modules[name]\n"
        "sys.modules['pytest'] = None\n"
        "import opd_store.testing as testing\n"
        "print(testing.FaultyStorage.__name__)\n"
        "try:\n"
        "    testing.StorageConformance\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "FaultyStorage", "opd_store.testing.StorageConformance: the conformance suite runs under pytest (pip install pytest)"]
