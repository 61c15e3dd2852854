"""What PyTorch's own DCP tests found, fixed: ranks with nothing to write (every backend, either
order of the coordinator and the others), DCP's plan cache, DCP's process-based ``async_save``, and
the stream transforms and ``save_id`` DCP's own writers offer.

The rank cases share one launch of 8 gloo ranks (tests/dcp/harness.py,
tests/dcp/scenarios_dcp_plans.py); the rest run in this process.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import run_launch
from opd_testkit.stores import Backend, open_store

from opd_store import CheckpointStore, TieredStore
from opd_store.dcp import StoreReader, StoreWriter, load, save
from opd_store.errors import StreamTransformError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _stored_names(backend: Backend, step: int, attempt_id: str) -> set[str]:
    fs, root = backend.raw_fs(), backend.raw_root()
    return {path.rsplit("/", 1)[-1] for path in fs.find(f"{root}/step-{step:06d}/{attempt_id}")}


def check_empty_ranks(backend: Backend, ranks: list[dict], sizes) -> None:
    """What ``scenario_empty_ranks`` committed on ``backend``: each step's manifest names exactly
    the files stored (one data file where DCP kept the replicated tensor's one copy), the step
    verifies deeply, and every rank loaded back what was saved."""
    store = open_store(backend)
    for size in sizes:
        replicated, uneven = store.manifest(100 + size), store.manifest(110 + size)
        for step, manifest in ((100 + size, replicated), (110 + size, uneven)):
            names = {entry.name for entry in manifest.payloads}
            assert manifest.world_size == size and _stored_names(backend, step, manifest.attempt_id) == names
            assert store.verify(step, deep=True).ok
        data_files = sorted(name for name in (e.name for e in replicated.payloads) if name.endswith(".distcp"))
        assert len(data_files) == 1, data_files  # one copy of the replicated tensor; every other part empty
        rows = size // 2 + 1
        for rank in range(size):
            loaded = ranks[rank]["empty_ranks"]["loaded"]
            assert loaded[str(100 + size)] == {"replicated": [0.0, 1.0, 2.0, 3.0]}
            assert loaded[str(110 + size)] == {
                "replicated": [0.0, 1.0, 2.0, 3.0],
                "uneven": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3).tolist()}


@pytest.mark.timeout(900)
def test_empty_ranks_plan_caching_and_the_process_executor(tmp_path):
    """One launch of 8 ranks on a local store (local stores fsync directories, where a rank with
    nothing to write failed every save):

    * replicated values from 2, 4 and 8 ranks, the coordinator held back by a barrier until every
      other rank sealed its (empty) part, and replicated values with uneven shards: each committed,
      its manifest naming exactly the files stored (one data file where DCP kept one copy), loaded
      back equal on every rank;
    * three consecutive saves with ``enable_plan_caching=True`` at 2 and 4 ranks, each under its own
      attempt, every element loaded back equal; a writer not told the group refuses a cached plan;
    * ``async_save`` with DCP's process executor commits what the thread executor commits, and the
      same refusal reaches ``result()`` the same way from both.
    """
    backend = Backend("local", str(tmp_path / "store"), {})
    ranks = run_launch({"world_size": 8, "module": "scenarios_dcp_plans",
                        "scenarios": ["empty_ranks", "plan_caching", "process_async"],
                        "backend": backend.to_json()}, tmp_path / "run")
    assert all("error" not in scenario for rank in ranks for scenario in rank.values()), ranks
    store = open_store(backend)

    check_empty_ranks(backend, ranks, (2, 4, 8))

    # plan caching: each save its own attempt, listing every rank's shard file
    caching = ranks[0]["plan_caching"]
    # the first save fills DCP's cache; on the next two every rank's plan came from it
    assert caching["cached_plans"] == {"21": 0, "22": 2, "23": 2, "41": 0, "42": 4, "43": 4, "31": 0, "32": 2}
    for size, steps in ((2, (21, 22, 23)), (4, (41, 42, 43))):
        attempts = {store.manifest(step).attempt_id for step in steps}
        assert len(attempts) == 3
        for step in steps:
            manifest = store.manifest(step)
            assert caching["saved"][str(step)] == store.step_url(step)
            assert {f"__{rank}_0.distcp" for rank in range(size)} <= {e.name for e in manifest.payloads}
            assert _stored_names(backend, step, manifest.attempt_id) == {e.name for e in manifest.payloads}
            assert caching["compared"][str(step)]["differing"] == [] and caching["compared"][str(step)]["tensors"] == 16
    assert caching["no_group_31"] == "committed"
    assert "CheckpointException" in caching["no_group_32"] and "pass StoreWriter(..., process_group=" in caching["no_group_32"]

    # the process executor: the same commit, the same errors
    process = ranks[0]["process_async"]
    assert process["thread"] == store.step_url(51) and process["process"] == store.step_url(52)
    thread_manifest, process_manifest = store.manifest(51), store.manifest(52)
    assert {e.name for e in thread_manifest.payloads} == {e.name for e in process_manifest.payloads}
    assert thread_manifest.writer.pid == process["pid"] != process_manifest.writer.pid  # DCP's background process
    for step, manifest in ((51, thread_manifest), (52, process_manifest)):
        assert manifest.world_size == 2 and store.verify(step, deep=True).ok
        assert process[f"compared_{step}"]["differing"] == [] and process[f"compared_{step}"]["tensors"] == 16
    for rank in (0, 1):
        refused = {kind: ranks[rank]["process_async"][f"refused_{kind}"] for kind in ("thread", "process")}
        for outcome in refused.values():
            assert outcome["type"] == "DistributedSaveError" and outcome["failures"] == [1], refused
            assert "rank 1 failed: UnsafeCheckpointError: key 'extra.rank1'" in outcome["message"], refused
        assert refused["thread"]["message"].replace("step-000053", "S").replace("step 53", "s") == \
            refused["process"]["message"].replace("step-000054", "S").replace("step 54", "s")
        assert ranks[rank]["process_async"]["memory"].startswith("TypeError: CheckpointStore('memory://")
    assert 53 not in ranks[0]["process_async"]["steps"] and 54 not in ranks[0]["process_async"]["steps"]


def test_an_empty_part_seals_without_touching_storage(backend):
    """A rank's part with no payloads seals to no entries and creates nothing, before the committing
    rank wrote anything (the step directory does not exist yet on a local store)."""
    store = open_store(backend)
    txn = store.begin(3, world_size=2)
    part = store.begin_part(3, attempt_id=txn.attempt_id, rank=1, world_size=2)
    assert part.seal() == ()
    assert store.storage.list_tree("") == {}
    txn.write_bytes("a.bin", b"abc")
    assert txn.commit() == store.step_url(3)
    assert [entry.name for entry in store.manifest(3).payloads] == ["a.bin"]


def test_stream_transforms_are_applied_recorded_and_required(tmp_path):
    """``extensions=[ZStandard()]``: every item compressed (the files smaller than without), the
    transform named in DCP's metadata and in the manifest, read back by StoreReader and by DCP's own
    FileSystemReader; a reader whose registry lacks a transform fails naming URL, step and file."""
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry

    store = CheckpointStore(tmp_path / "store")
    state = {"w": torch.zeros(4096), "b": torch.arange(64.0), "note": {"text": "x" * 200}}
    save(state, store, 1)
    save(state, store, 2, extensions=[ZStandard()])
    plain, packed = store.manifest(1), store.manifest(2)
    assert packed.metadata["dcp_stream_transforms"] == ["stream.zstd/1"]
    assert "dcp_stream_transforms" not in plain.metadata
    size = {manifest.step: sum(e.size_bytes for e in manifest.payloads if e.name.endswith(".distcp"))
            for manifest in (plain, packed)}
    assert size[2] < size[1] // 4, size
    metadata = StoreReader(store, 2).read_metadata()
    assert {tuple(info.transform_descriptors) for info in metadata.storage_data.values()} == {("stream.zstd/1",)}
    assert metadata.storage_meta.save_id == packed.attempt_id
    for reader in (StoreReader(store, 2), dcp.FileSystemReader(str(tmp_path / "store" / "step-000002" / packed.attempt_id))):
        target = {"w": torch.ones(4096), "b": torch.zeros(64), "note": {"text": ""}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
        assert target["note"] == state["note"]

    save(state, store, 3, extensions=[Rot13Example()])
    target = {"w": torch.ones(4096), "b": torch.zeros(64), "note": {"text": ""}}
    with pytest.raises(StreamTransformError, match=r"step-000003 \(step 3\): rank 0's DCP file __0_\d.distcp .*"
                                                   r"'stream.rot13/1'"):
        load(target, store, 3)
    assert torch.equal(target["w"], torch.ones(4096))  # refused before any tensor changed
    load(target, store, 3, extension_registry=get_test_extension_registry())
    assert torch.equal(target["w"], state["w"]) and target["note"] == state["note"]


def test_writers_and_readers_pickle_as_their_store_address(tmp_path, moto_s3):
    """A writer and a reader pickle without their clients and rebuild their store from its URL and
    options (S3: a new client in the other process); what another process cannot rebuild as the
    same store is refused naming it; a step URL is what validate_checkpoint_id accepts."""
    backend = moto_s3.new_backend()
    store = CheckpointStore(backend.url, storage_options=backend.portable_options())
    writer = pickle.loads(pickle.dumps(StoreWriter(store, 4, metadata={"run": "a"})))
    assert writer.store is not store and writer.store.url == store.url and writer.checkpoint_id == store.step_url(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0)}, storage_writer=writer, no_dist=True)
    assert store.manifest(4).metadata["run"] == "a"
    reader = pickle.loads(pickle.dumps(StoreReader(store, 4)))
    target = {"w": torch.zeros(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert target["w"].tolist() == list(range(8))

    with pytest.raises(TypeError, match="memory:// is one store per process"):
        pickle.dumps(StoreWriter("memory://pickled/run", 1))
    with TieredStore(tmp_path / "local", store) as tiered:
        with pytest.raises(TypeError, match="only a plain CheckpointStore"):
            pickle.dumps(StoreReader(tiered, 4))
    from opd_store.pipeline import AfterCommit

    with pytest.raises(TypeError, match="after_commit stage"):
        pickle.dumps(StoreWriter(store, 5, after_commit=AfterCommit(store, 5)))
    assert StoreWriter.validate_checkpoint_id(store.step_url(5)) and StoreReader.validate_checkpoint_id(store.step_url(5))
    assert not StoreWriter.validate_checkpoint_id(store.url) and not StoreReader.validate_checkpoint_id("abc://x/step-000001")


def test_plan_caching_in_one_process(tmp_path):
    """One process: DCP's cached plans (the second and third save) need no broadcast, the
    coordinator writes under its own attempt; each step loads back its own values."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    store = CheckpointStore(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2, 3):
            planner = type("CachingPlannerOneProcess", (DefaultSavePlanner,), {})(enable_plan_caching=True)
            dcp.save({"w": torch.arange(4.0) + step}, storage_writer=StoreWriter(store, step), planner=planner,
                     no_dist=True)
    assert len({store.manifest(step).attempt_id for step in (1, 2, 3)}) == 3
    for step in (1, 2, 3):
        target = {"w": torch.zeros(4)}
        load(target, store, step)
        assert target["w"].tolist() == [step, step + 1.0, step + 2.0, step + 3.0]


_UPSTREAM_LIKE = '''
import json, os, sys
sys.path[:0] = [os.environ["REPO"], os.path.join(os.environ["REPO"], "bench", "upstream_dcp", "site")]
import sitecustomize  # what every process of `python -m bench.upstream_dcp` runs first
import torch
import torch.distributed.checkpoint as dcp

path = sys.argv[1]
dcp.save({"w": torch.arange(3.0)}, checkpoint_id=path)           # DCP picks a writer for a bare path
dcp.save({"w": torch.arange(3.0) + 1}, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
target = {"w": torch.zeros(3)}
dcp.load(target, checkpoint_id=path)
print(json.dumps({"loaded": target["w"].tolist(), "reader": type(dcp.FileSystemReader(path)).__mro__[1].__name__}))
'''


def test_the_pytorch_tests_runner_routes_dcp_through_a_store(tmp_path):
    """``python -m bench.upstream_dcp``'s substitution (docs/upstream-tests.md), in a process of its
    own with the runner's ``sitecustomize``: DCP's ``FileSystemWriter`` and a bare ``checkpoint_id``
    save each save as a new committed step of a store at the test's path; ``FileSystemReader`` reads
    the newest through StoreReader (``local``) or DCP's own reader of the committed attempt
    (``dcp-reader``)."""
    import json
    import os
    import sys
    from pathlib import Path

    from opd_testkit import forkserver

    script = tmp_path / "upstream_like.py"
    script.write_text(_UPSTREAM_LIKE)
    repo = str(Path(__file__).resolve().parents[2])
    for mode, reader_base in (("local", "StoreReader"), ("dcp-reader", "FileSystemReader")):
        env = dict(os.environ, OPD_UPSTREAM_DCP=mode, REPO=repo)
        done = forkserver.run([sys.executable, str(script), str(tmp_path / mode)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"loaded": [1.0, 2.0, 3.0], "reader": reader_base}
        store = CheckpointStore(tmp_path / mode)
        assert store.steps() == [1, 2] and all(store.verify(step, deep=True).ok for step in (1, 2))
