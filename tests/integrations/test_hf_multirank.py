"""Two gloo ranks of a real transformers Trainer with StoreCallback: each rank's RNG file is its own
part of the attempt, one manifest (world_size 2) names both, and a 2-rank resume from the store
fetches and continues. The reference pair uploads asynchronously (rank 0's write and commit on its
background worker after rank 1 sealed its part). Then the 2-rank store with rank 1's file of its
newest step missing: the "missing rank file" row of the damaged-resume table
(tests/integrations/test_hf_damage_table.py)."""

from __future__ import annotations

import pytest
import rank_child
from opd_testkit.damage import damage_payload
from opd_testkit.hf import tiny_trainer
from opd_testkit.stores import Backend

from opd_store import CheckpointStore, IntegrityError
from opd_store.integrations.transformers import StoreCallback, store_checkpoint
from opd_store.ledger import read_journal

pytestmark = pytest.mark.timeout(600)


def _run(tmp_path, store_url, outs, stop_at, resume, probe=False, async_upload=False):
    results = []
    for stream in rank_child.start_pair(tmp_path, store_url, outs, stop_at, resume, probe, async_upload):
        (result,) = stream.until(lambda event: event["event"] == "result")
        assert stream.process.wait(60) == 0
        results.append(result)
    return results


def test_each_rank_uploads_its_own_files_and_one_manifest_commits(tmp_path, caplog):
    store_url = str(tmp_path / "store")
    outs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    first = _run(tmp_path, store_url, outs, 2, resume=False, probe=True)
    assert [r["world_size"] for r in first] == [2, 2]
    assert first[1]["files"] == ["rng_state_1.pth"]  # rank 1's machine holds only its own file
    assert "rng_state_1.pth" not in first[0]["files"]
    store = CheckpointStore(store_url)
    manifest = store.manifest(2)
    assert manifest.world_size == 2 and manifest.writer.rank == 0
    names = {entry.name for entry in manifest.payloads}
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "trainer_state.json", "model.safetensors"} <= names
    assert store.read(2, "rng_state_1.pth") == (tmp_path / "rank1" / "checkpoint-2" / "rng_state_1.pth").read_bytes()
    assert store.verify(2, deep=True).ok
    # a commit whose directory lacks rank 1's file fails alone on rank 1: both ranks raise the same
    # DistributedSaveError naming rank 1, the file, the store and the step, and nothing of step 3 stays
    for result in first:
        name, ranks, message = result["commit_error"]
        assert (name, ranks) == ("DistributedSaveError", [1])
        assert message.startswith(f"{store_url}/step-000003: step 3 was not committed: rank 1 failed: "
                                  "IncompleteCheckpointError: ")
        assert "checkpoint-3: the Trainer's checkpoint of step 3 is incomplete on rank 1 (rng_state_1.pth is missing)" in message
    assert [info.step for info in store.checkpoints()] == [2]

    # a second pair of "machines" resumes from the store (both ranks' files fetched) and continues
    resumed = _run(tmp_path, store_url, [str(tmp_path / "r0"), str(tmp_path / "r1")], 4, resume=True, probe=True)
    assert all(r["resumed"].endswith("checkpoint-2") for r in resumed)
    # a fetch that fails on rank 1 alone (its directory cannot be created) fails on both ranks
    for result in resumed:
        name, ranks, message = result["fetch_error"]
        assert (name, ranks) == ("DistributedLoadError", [1]) and "rank 1 failed: NotADirectoryError" in message
    # two "hosts" sharing one output directory fetch it once (not twice into the same path)
    shared = str(tmp_path / "shared-output" / "checkpoint-2")
    assert [r["shared_fetch"][0] for r in resumed] == [shared, shared]
    assert sum(r["shared_fetch"][1] for r in resumed) == 1
    assert resumed[0]["shared_fetch"][2] == sorted(entry.name for entry in store.manifest(2).payloads)
    assert store.steps() == [2, 4] and store.manifest(4).metadata["parent_step"] == 2
    reference = _run(tmp_path, str(tmp_path / "ref-store"), [str(tmp_path / "f0"), str(tmp_path / "f1")], 4,
                     resume=False, async_upload=True)
    assert resumed[0]["loss"] == reference[0]["loss"] and len(reference[0]["loss"]) == 4
    # rank 0 committed both steps on its worker (rank 1 commits nothing: it writes its part)
    assert [r["committed_steps"] for r in reference] == [[2, 4], []]
    ref_store = CheckpointStore(str(tmp_path / "ref-store"))
    assert ref_store.steps() == [2, 4] and ref_store.manifest(4).world_size == 2 and ref_store.verify(4, deep=True).ok
    # rank 1's generators after step 4 equal the uninterrupted run's: its part was fetched and restored
    assert store.read(4, "rng_state_1.pth") == ref_store.read(4, "rng_state_1.pth")
    # rank 0 journaled each save, synchronous or on its worker, with both ranks' bytes and requests
    for journaled, steps in ((store, [2, 4]), (ref_store, [2, 4])):
        saves = [e for e in read_journal(journaled).events if e.kind == "save"]
        assert [(e.step, e.size_bytes, e.requests["put"], e.world_size) for e in saves] == [
            (step, journaled.manifest(step).total_size_bytes, len(journaled.manifest(step).payloads) + 1, 2)
            for step in steps]  # a PUT per payload (rank 1's too) and one for the manifest

    # rank 1's file of step 4 missing: the fetch resumes step 2 with a warning naming it; a run
    # resuming step 2 with the callback stops before training (it would save step 4 again)
    rel = damage_payload(Backend("local", store_url, {}), 4, "rng_state_1.pth", "delete")
    path = store_checkpoint(store_url, tmp_path / "fetch")
    assert path == str(tmp_path / "fetch" / "checkpoint-2")
    (warning,) = [r.getMessage() for r in caplog.records if "skipped step 4" in r.getMessage()]
    assert warning.startswith(f"{store_url}: skipped step 4 (incomplete: ") and rel.split("/", 1)[1] in warning
    trainer = tiny_trainer(str(tmp_path / "fetch"), callbacks=[StoreCallback(store_url)])
    with pytest.raises(IntegrityError, match=rf"^{store_url}/step-000004: step 4 is damaged \(.*rng_state_1\.pth"):
        trainer.train(resume_from_checkpoint=path)
    assert trainer.state.global_step == 2
