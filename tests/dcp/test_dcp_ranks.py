"""The DCP storage layer with real gloo ranks: resharding, failures, damaged files, every backend.

Each test is one launch of ranks (tests/dcp/harness.py) running several scenarios in turn
(tests/dcp/scenarios_dcp.py); the assertions read what every rank observed and the store itself.
One test per launch, so ``pytest -n`` never starts a launch twice.
"""

from __future__ import annotations

import pytest
from harness import run_launch
from opd_testkit.stores import Backend, open_store

pytestmark = pytest.mark.timeout(900)


def _crc32c_hex(data: bytes) -> str:
    import crc32c  # the independent implementation (opd_store uses awscrt's)

    return f"{crc32c.crc32c(data):08x}"


def _check_manifest_lists_every_rank(backend: Backend, step: int, world_size: int) -> None:
    """Every rank's files are in the manifest with the size and CRC32C of the stored bytes."""
    store = open_store(backend)
    manifest = store.manifest(step)
    assert manifest.world_size == world_size
    assert manifest.metadata["checkpoint_format"] == "dcp"
    assert manifest.metadata["mesh_shape"] == [world_size]
    names = {entry.name for entry in manifest.payloads}
    assert {f"__{rank}_0.distcp" for rank in range(world_size)} <= names, names
    assert ".metadata" in names
    fs, root = backend.raw_fs(), backend.raw_root()
    listed = {path.rsplit("/", 1)[-1] for path in fs.find(f"{root}/step-{step:06d}/{manifest.attempt_id}")}
    assert listed == names  # nothing else under the attempt, nothing renamed
    for entry in manifest.payloads:
        data = fs.cat_file(f"{root}/step-{step:06d}/{entry.path}")
        assert (len(data), _crc32c_hex(data)) == (entry.size_bytes, entry.crc32c), entry.name


def test_resharding_between_1_2_4_and_8_ranks(tmp_path):
    """Saved from W ranks, loaded on W' for W, W' in {1, 2, 4} and 8 -> 2: every element of every
    parameter and optimizer-state tensor equal (FSDP2 on a CPU mesh, get/set_state_dict)."""
    backend = Backend("local", str(tmp_path / "store"), {})
    ranks = run_launch({"world_size": 8, "module": "scenarios_dcp", "scenarios": ["resharding", "reader_contract"],
                        "backend": backend.to_json()}, tmp_path / "run")
    assert all("error" not in scenario for rank in ranks for scenario in rank.values()), ranks
    pairs = ranks[0]["resharding"]["pairs"]
    assert sorted(pairs) == ["1->1", "1->2", "1->4", "2->1", "2->2", "2->4", "4->1", "4->2", "4->4", "8->2"]
    for pair, outcome in pairs.items():
        # 2 Linear layers: 4 parameters, and AdamW's step, exp_avg, exp_avg_sq for each
        assert outcome["tensors"] == 16 and outcome["elements"] == 418 and outcome["differing"] == [], pair
    for size in (1, 2, 4, 8):
        _check_manifest_lists_every_rank(backend, size, size)
    assert ranks[0]["reader_contract"]["uncommitted"] == "CheckpointNotFoundError"


@pytest.mark.parametrize("backend_name", ["s3", "gcs"])
def test_dcp_on_remote_backends(backend_name, request, tmp_path):
    """4 ranks on S3 (moto) or GCS (fake-gcs-server): plain dcp.save with StoreWriter, a resharded
    load, dcp.async_save, a failing rank, and missing, truncated and corrupted rank files; ranks
    with nothing to write (tests/dcp/test_dcp_plans.py) at 2 and 4 ranks."""
    from test_dcp_plans import check_empty_ranks

    backend = request.getfixturevalue(f"{backend_name}_backend")  # tests/conftest.py: a clean bucket
    ranks = run_launch({"world_size": 4, "module": "scenarios_dcp", "scenarios": ["backend", "empty_ranks"],
                        "backend": backend.to_json()}, tmp_path / "run")
    results = [rank["backend"] for rank in ranks]
    assert all("error" not in result for result in results), results
    zero = results[0]
    assert zero["url"].endswith("/step-000001")
    assert zero["reshard_4_to_2"]["differing"] == [] and zero["reshard_4_to_2"]["elements"] == 418
    assert zero["async_url"].endswith("/step-000006") and zero["async_roundtrip"]["differing"] == []

    # a rank whose write failed: the same error on every rank, naming rank 2; nothing committed
    failed = [result["failed_save"] for result in results]
    assert all(f["type"] == "DistributedSaveError" for f in failed), failed
    assert len({f["message"] for f in failed}) == 1 and "rank 2 failed: OSError: injected write failure" in failed[0]["message"]
    assert set(failed[0]["failures"]) == {"2"}
    assert zero["steps_after_failure"] == [1, 6] and zero["latest_after_failure"] == 6

    # damaged files: a typed error naming step, rank and file, the same on every rank, no tensor changed
    expected = {"delete": ("IncompleteCheckpointError", "step 2", "rank 1's DCP file __1_0.distcp"),
                "truncate": ("IncompleteCheckpointError", "step 3", "rank 2's DCP file __2_0.distcp"),
                "flip": ("IntegrityError", "step 4", "rank 3's DCP file __3_0.distcp")}
    for how, (error_type, step_text, file_text) in expected.items():
        outcomes = [result[how] for result in results]
        assert all(o.get("error", {}).get("type") == error_type for o in outcomes), (how, outcomes)
        assert len({o["error"]["message"] for o in outcomes}) == 1, (how, outcomes)
        assert step_text in outcomes[0]["error"]["message"] and file_text in outcomes[0]["error"]["message"], outcomes
        assert all(o["unchanged"] for o in outcomes), (how, outcomes)
    # resharded on 2 ranks, rank 1 reads old rank 3's file: both ranks raise its IntegrityError
    flipped = [result["flip_on_2"] for result in results[:2]]
    assert [o["error"]["type"] for o in flipped] == ["IntegrityError", "IntegrityError"], flipped
    assert all(o["unchanged"] for o in flipped)
    assert zero["latest_at_end"] == 6
    _check_manifest_lists_every_rank(backend, 1, 4)
    _check_manifest_lists_every_rank(backend, 6, 4)
    check_empty_ranks(backend, ranks, (2, 4))
