"""The main job (``opd-store train``) as an entry point of the damaged-checkpoint rule
(docs/resume.md, "A damaged checkpoint"), its one download per resume, and an elastic resume of a
checkpoint that predates ``samples_done``.

One real job run (``--updates 2 --checkpoint-every 1``: steps 1 and 2) is made once and copied:

* each kind of damage of step 2 (a payload deleted, truncated, one byte flipped; the rank's own
  RNG file deleted) stops the rerun before any update, exit 4, with one line naming the step, the
  file and ``opd-store delete`` (the run resumed from step 1 would save step 2 again), a warning
  naming the skipped step, and nothing committed changed;
* resumed on S3 (moto behind a recording proxy), every payload of the resumed step is read once:
  the guard's deep check and the load share one download;
* a checkpoint of two ranks whose trainer state has no ``samples_done`` (an earlier version's),
  resumed elastically on one rank, continues at the global sample index of two ranks.
"""

from __future__ import annotations

import io
import logging
import shutil

import pytest
import torch
from opd_testkit.damage import DAMAGE_KINDS, damage_payload
from opd_testkit.reads import payload_reads
from opd_testkit.resume_rule import assert_stop_line, files_under
from opd_testkit.stores import Backend, open_store

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.job import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

JOB = ["--updates", "2", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def job_store(tmp_path_factory):
    """A real job's store (steps 1 and 2), made once."""
    root = tmp_path_factory.mktemp("job") / "store"
    assert main(["train", "--store", str(root), *JOB, "--log", str(root.parent / "ref.log")]) == 0
    assert CheckpointStore(root).steps() == [1, 2]
    return root


@pytest.mark.parametrize("kind", (*DAMAGE_KINDS, "missing rank file"))
def test_a_damaged_newest_step_stops_the_job_before_training(kind, job_store, tmp_path, capsys, caplog):
    root = tmp_path / "store"
    shutil.copytree(job_store, root)
    store = CheckpointStore(root)
    backend = Backend("local", str(root), {})
    # One rank: its own file is rng.pt.
    path = (damage_payload(backend, 2, "rng.pt", "delete") if kind == "missing rank file"
            else damage_payload(backend, 2, "training_state.pt", kind))
    before = files_under(root)
    capsys.readouterr()
    caplog.set_level(logging.WARNING)
    log = tmp_path / "run.log"
    assert main(["train", "--store", str(root), *JOB, "--log", str(log)]) == 4
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"opd-store train: error: {store.step_url(2)}: step 2 is damaged (")
    assert "this run (resuming from step 1, --updates 2) would save step 2 again" in error
    assert_stop_line(error, store_url=store.url, step=2, file=path)
    skipped = [r.getMessage() for r in caplog.records if "skipped step 2" in r.getMessage()]
    assert len(skipped) == 1 and path.split("/", 1)[1] in skipped[0]
    assert not log.exists() or not log.read_text().strip()  # no update ran
    assert files_under(root) == before


def _put_tree(root, backend: Backend) -> None:
    fs, remote = backend.raw_fs(), backend.raw_root()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{remote}/{path.relative_to(root)}", path.read_bytes())


def test_a_resume_on_s3_reads_each_payload_once(job_store, s3_fault_proxy, tmp_path):
    backend, proxy = s3_fault_proxy
    _put_tree(job_store, backend)
    store = open_store(backend)
    del proxy.requests[:]
    result = train(store=store, updates=2, checkpoint_every=1, log=open(tmp_path / "log", "w"))  # noqa: SIM115
    assert (result.resumed_step, result.successful_updates, result.saves) == (2, 2, [])
    reads = payload_reads(proxy.requests, backend, 2, store.manifest(2))
    assert reads and all(times == (1, 1) for times in reads.values()), reads  # verified and loaded from one GET
    assert set(payload_reads(proxy.requests, backend, 1, store.manifest(1)).values()) == {(0, 0)}


def test_an_elastic_resume_without_samples_done_counts_at_the_saved_world_size(job_store, tmp_path):
    """A two-rank checkpoint of an earlier version (no ``samples_done``: each rank's cursor was
    ``query_update * W + r`` at the saved world size W = 2) resumed on one rank under ``elastic``:
    the next prompt is the one after the 2 ranks' last ones, not the 1 rank's."""
    source = CheckpointStore(job_store)
    manifest = source.manifest(2)
    state = torch.load(io.BytesIO(source.read(2, "training_state.pt")), weights_only=True)
    queries = state["trainer"]["query_update"]  # one per attempted update
    assert state["trainer"].pop("samples_done") == queries * 1 * 2  # one rank, 2 prompts per update
    state.update(schema="opd_checkpoint_v2", world_size=2)
    older = CheckpointStore(tmp_path / "older")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with older.begin(2, world_size=2, metadata={**manifest.metadata, "world_size": 2}) as txn:
        for name in source.names(2):
            if name not in ("training_state.pt", "rng.pt"):
                txn.write_bytes(name, source.read(2, name))
        txn.write_bytes("training_state.pt", buffer.getvalue())
        for rank in (0, 1):
            txn.write_bytes(f"rng-rank-{rank:02d}.pt", source.read(2, "rng.pt"))
    final = tmp_path / "final.pt"
    events = tmp_path / "events"
    with open(events, "w") as handle:
        result = train(store=older, updates=2, checkpoint_every=1, resume_mode="elastic", events=handle,
                       log=open(tmp_path / "log", "w"), final_state_path=str(final))  # noqa: SIM115
    assert result.resumed_step == 2
    assert '"saved_world_size": 2' in events.read_text() and '"unclaimed_ranks": [1]' in events.read_text()
    assert torch.load(final, weights_only=True)["trainer"]["samples_done"] == queries * 2 * 2  # not queries * 1 * 2
