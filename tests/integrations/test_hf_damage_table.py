"""The Hugging Face rows of the damaged-resume table: ``store_checkpoint`` and ``StoreCallback``
(through ``resume_from_store``) x each kind of damage to the newest checkpoint, on S3 (moto).

The rule (docs/resume.md; :mod:`opd_store.store._resume_guard`): a damaged newest checkpoint is
skipped with a warning naming the step and the file, and the newest intact one is resumed where
the resumed run cannot collide with the damaged step; the Trainer would save that step again, so
with the callback the run stops before training with one line naming the step, the file and the
remedy. Never a silent fresh start, never a load of damaged bytes. The missing rank file of a
2-rank checkpoint is the same row on the 2-rank store of tests/integrations/test_hf_multirank.py.
"""

from __future__ import annotations

import pytest
from opd_testkit.damage import damage_payload
from opd_testkit.hf import tiny_trainer

from opd_store import CheckpointStore, IntegrityError
from opd_store.integrations.transformers import StoreCallback, resume_from_store, store_checkpoint
from opd_store.job._machines import torch_threads

pytestmark = pytest.mark.xdist_group("hf-damage-table")
"""One worker runs the module: its module fixture (a trained checkpoint) is built once."""

# (kind, payload): the kinds of opd_testkit.damage; a missing rank file of a one-process run is its
# rng_state.pth deleted
DAMAGE = [("delete", "optimizer.pt"), ("truncate", "optimizer.pt"), ("flip", "model.safetensors"),
          ("delete", "rng_state.pth")]
IDS = ["deleted", "truncated", "flipped", "missing-rank-file"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A local store holding steps 2 and 4 of a 4-step run (one process), made once."""
    base = tmp_path_factory.mktemp("hf-damage")
    with torch_threads(1):
        tiny_trainer(str(base / "out"), callbacks=[StoreCallback(str(base / "store"))]).train()
    assert CheckpointStore(str(base / "store")).steps() == [2, 4]
    return base / "store"


@pytest.fixture
def damaged(two_steps, opd_s3_backend, request):
    """The two steps copied object by object into a fresh S3 bucket, then step 4 damaged there;
    yields (backend, the damaged payload's path relative to the store root, its name)."""
    kind, name = request.param
    fs, root = opd_s3_backend.raw_fs(), opd_s3_backend.raw_root()
    for path in sorted(p for p in two_steps.rglob("*") if p.is_file()):
        fs.pipe_file(f"{root}/{path.relative_to(two_steps).as_posix()}", path.read_bytes())
    return opd_s3_backend, damage_payload(opd_s3_backend, 4, name, kind), name


def _objects(backend) -> dict[str, int]:
    return {path: info["size"] for path, info in backend.raw_fs().find(backend.raw_root(), detail=True).items()}


@pytest.mark.parametrize("damaged", DAMAGE, ids=IDS, indirect=True)
def test_store_checkpoint_skips_the_damaged_step_with_a_warning(damaged, tmp_path, caplog):
    backend, rel, name = damaged
    path = store_checkpoint(backend.url, tmp_path / "fetch", storage_options=backend.storage_options)
    assert path == str(tmp_path / "fetch" / "checkpoint-2")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "skipped step" in r.getMessage()]
    assert warning.startswith(f"{backend.url}: skipped step 4 (") and rel.split("/", 1)[1] in warning, warning
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert {p.name for p in (tmp_path / "fetch").iterdir()} == {"checkpoint-2"}  # nothing of step 4, no temp left
    for entry in store.manifest(2).payloads:
        assert (tmp_path / "fetch" / "checkpoint-2" / entry.name).read_bytes() == store.read(2, entry.name), entry.name


@pytest.mark.parametrize("damaged", DAMAGE, ids=IDS, indirect=True)
def test_the_callback_stops_before_training_in_one_line(damaged, tmp_path):
    backend, rel, name = damaged
    before = _objects(backend)
    options = backend.storage_options
    trainer = tiny_trainer(str(tmp_path / "out"), callbacks=[StoreCallback(backend.url, storage_options=options)])
    with pytest.raises(IntegrityError) as raised:
        resume_from_store(trainer, backend.url, storage_options=options)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{backend.url}/step-000004: step 4 is damaged (")
    assert rel.split("/", 1)[1] in message  # the file: attempt-.../<name>
    assert message.endswith(f"remove it with `opd-store delete {backend.url} 4`, then rerun the same command")
    assert trainer.state.global_step == 2  # resumed state loaded, nothing trained
    assert _objects(backend) == before  # nothing in the store changed


@pytest.mark.parametrize("damaged", [("flip", "optimizer.pt")], ids=["flipped"], indirect=True)
def test_after_the_remedy_the_same_line_resumes_from_the_step_before(damaged, tmp_path):
    backend, _rel, _name = damaged
    options = backend.storage_options
    store = CheckpointStore(backend.url, storage_options=options)
    store.delete(4)  # what `opd-store delete URL 4` does to a damaged step
    trainer = tiny_trainer(str(tmp_path / "out"), callbacks=[StoreCallback(backend.url, storage_options=options)])
    resume_from_store(trainer, backend.url, storage_options=options)
    assert trainer.state.global_step == 4 and store.steps() == [2, 4] and store.verify(4, deep=True).ok
    assert store.manifest(4).metadata["parent_step"] == 2
