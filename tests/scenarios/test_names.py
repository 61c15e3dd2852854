"""Configuration and names: a store at ``s3://bucket/run`` or
``gs://bucket/run`` (and their aliases ``s3a://``, ``gcs://``): every URL the API returns keeps the
protocol the caller wrote, and a fresh process resumes from the returned URL."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
from pathlib import Path

import pytest
import torch
from opd_testkit import forkserver

from opd_store import CheckpointStore, latest_complete_checkpoint
from opd_store.errors import CheckpointNotFoundError, IncompleteCheckpointError
from opd_store.opd import load_opd_checkpoint

from .helpers import PROVENANCE, PYTHON, adapter_tensors, base_state, config, fresh_machine, save, student, trainable

HERE = Path(__file__).resolve().parent


def _bucket_options(kind: str, request) -> dict:
    if kind == "s3":
        moto = request.getfixturevalue("moto_s3")
        moto.new_backend(bucket="bucket")  # moto reset, then an empty "bucket"
        return moto.storage_options()
    gcs = request.getfixturevalue("fake_gcs")
    try:
        gcs.create_bucket("bucket")
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # already there from an earlier test of this session
            raise
    options = gcs.storage_options()
    import fsspec

    fs = fsspec.filesystem("gs", skip_instance_cache=True, **options)
    if fs.exists("bucket/run"):
        fs.rm("bucket/run", recursive=True)
    return options


def _adapter_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(adapter_tensors(model).items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def _every_url(root: str, options: dict) -> tuple[list[str], object]:
    """Save steps 2 and 4 under ``root`` and collect every URL the API hands back."""
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    store = CheckpointStore(root, storage_options=options)
    urls = [store.url, store.step_url(2)]
    urls.append(save(root, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(2),
                     storage_options=options))
    with torch.no_grad():
        for p in trainable(model):
            p.add_(0.5)
    urls.append(save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(4)))
    with store.begin(6) as txn:  # the plain store API too
        urls.append(txn.url)
        txn.write_bytes("note.txt", b"six")
    urls.append(txn.committed_url)
    urls += [info.url for info in store.checkpoints()]
    urls += [store.verify(step).url for step in (2, 4, 6)]
    urls.append(latest_complete_checkpoint(root, storage_options=options))
    urls.append(latest_complete_checkpoint(store))
    for message in _error_messages(root, options):
        urls.append(message)
    return urls, model


def _error_messages(root: str, options: dict) -> list[str]:
    out = []
    with pytest.raises(IncompleteCheckpointError) as caught:
        load_opd_checkpoint(f"{root}/step-000007", optimizer=None, scheduler=None, config=config(),
                            provenance_fingerprints=dict(PROVENANCE), teacher_state_loader=print,
                            storage_options=options)
    out.append(str(caught.value))
    with pytest.raises(CheckpointNotFoundError) as caught:
        latest_complete_checkpoint(f"{root}-empty", storage_options=options)
    out.append(str(caught.value))
    return out


@pytest.mark.parametrize(
    ("kind", "root"),
    [("s3", "s3://bucket/run"), ("s3", "s3a://bucket/run"), ("gcs", "gs://bucket/run"), ("gcs", "gcs://bucket/run")],
)
def test_every_returned_url_keeps_the_protocol(request, kind, root):
    """Store URL, step URLs, the URL ``save_opd_checkpoint`` returns, transaction
    URLs, listing and verify reports, ``latest_complete_checkpoint`` and the URLs inside error
    messages all start with the root as written (``s3a://`` and ``gcs://`` included, which
    fsspec alone would respell ``s3://``/``gs://``)."""
    options = _bucket_options(kind, request)
    urls, _model = _every_url(root, options)
    assert len(urls) == 16
    scheme = root.split("://")[0]
    for url in urls:
        assert root in url, url
        assert set(re.findall(r"([a-z0-9]+)://", url)) == {scheme}, url
    assert urls[2] == f"{root}/step-000002" and urls[3] == f"{root}/step-000004"
    assert urls[-3] == urls[-4] == f"{root}/step-000006"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kind", "root"), [("s3", "s3://bucket/run"), ("gcs", "gs://bucket/run")])
def test_fresh_process_resumes_from_returned_url(request, tmp_path, kind, root):
    """A fresh process (new empty cwd, HOME and TMPDIR; no state but the bucket)
    given the store URL finds the latest checkpoint under the same protocol and restores exactly
    the saved adapter and counters."""
    options = _bucket_options(kind, request)
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with torch.no_grad():
        for p in trainable(model):
            p.add_(0.25)
    url = save(root, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(3),
               storage_options=options)
    assert url == f"{root}/step-000003"
    env, cwd = fresh_machine(tmp_path)
    child = forkserver.run([PYTHON, str(HERE / "resume_child.py"), root, json.dumps(options)], env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=500)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result == {"latest": url, "successful_updates": 3, "adapter_sha256": _adapter_digest(model)}
