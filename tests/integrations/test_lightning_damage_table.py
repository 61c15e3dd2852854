"""The resume rule ([docs/resume.md](../../docs/resume.md#damaged-checkpoints)) at Lightning's entry
points, as a table: ``fit(ckpt_path="last")`` and ``fit(ckpt_path=<url>/last.ckpt)`` x each kind of
damage to ``last.ckpt``'s payload (:data:`opd_testkit.damage.DAMAGE_KINDS`), on S3 (moto behind a
recording proxy); both entry points of a kind meet one damaged copy of the store.

The store is a two-epoch run (4 steps an epoch, ``save_top_k=2``, ``save_last=True``): ``last.ckpt``
version 2 and the top-k names ``epoch=0-step=4.ckpt`` and ``epoch=1-step=8.ckpt``, each version 1.
``"last"`` resumes from the newest intact checkpoint (the top-k one of the same step) with one
warning naming the skipped version and its file (one row then trains an epoch on and evicts top-k
names as Lightning does: it used to start from step 0 and leave four top-k names); an explicit path stops before training in
one line naming the version, the file and the remedy. Each resume downloads every payload it reads
once (GET bytes per object, counted at the proxy).
"""

from __future__ import annotations

import dataclasses
import logging
from urllib.parse import unquote

import lightning_child
import pytest
import torch
from opd_testkit.damage import DAMAGE_KINDS, damage_payload

from opd_store.cli import main as cli_main
from opd_store.errors import IncompleteCheckpointError, IntegrityError
from opd_store.job._machines import torch_threads

pytestmark = pytest.mark.timeout(300)

RAISED = {"delete": IncompleteCheckpointError, "truncate": IncompleteCheckpointError, "flip": IntegrityError}
"""What an explicit load of the damaged version raises: a missing or short payload is seen in the
listing (nothing is downloaded), a flipped byte only by its CRC32C."""
FALLBACK = "epoch=1-step=8.ckpt"


@pytest.fixture(scope="module")
def template(moto_s3):
    """The two-epoch run, trained once on S3 at the URL every test's fresh bucket has (the callback
    state in a checkpoint holds its directory), as objects, and each name's checkpoint."""
    backend = moto_s3.new_backend()
    with torch_threads(1):
        trainer, model, train, val, plugin, _c = lightning_child.build(backend.url + "/ckpts", backend.storage_options,
                                                                       max_epochs=2)
        trainer.fit(model, train, val)
    states = {name: plugin.load_checkpoint(plugin.path_of(name)) for name in plugin.names()}
    assert {name: state["global_step"] for name, state in states.items()} == {
        "epoch=0-step=4.ckpt": 4, FALLBACK: 8, "last.ckpt": 8}
    return lightning_child.snapshot(backend), states


def _objects(backend) -> dict[str, int]:
    """Every object under the root with its size (one listing with the backend's own client)."""
    fs, raw = backend.raw_fs(), f"{backend.raw_root()}/ckpts"
    return {path[len(raw) + 1:]: info["size"] for path, info in fs.find(raw, detail=True).items()}


def _payload_size(objects: dict[str, bytes], name: str) -> int:
    (size,) = [len(data) for rel, data in objects.items() if rel.startswith(f"{name}/step-") and rel.endswith("/checkpoint.ckpt")]
    return size


def _payload_get_bytes(proxy, until_first_put: bool = False) -> dict[str, int]:
    """Bytes sent per payload object (``.../checkpoint.ckpt``) by GetObject requests, by the
    object's name under the root (with ``until_first_put``, in the requests before the first PUT)."""
    read: dict[str, int] = {}
    for request in proxy.requests:
        if until_first_put and request.method == "PUT":
            break
        path = unquote(request.path)
        if request.op == "GetObject" and path.endswith("/checkpoint.ckpt"):
            name = path.split("/ckpts/", 1)[1].split("/step-", 1)[0]
            read[name] = read.get(name, 0) + request.response_bytes
    return read


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_a_damaged_last_ckpt_stops_an_explicit_path_before_training_and_last_resumes_from_the_newest_intact_one(
        kind, template, s3_fault_proxy, caplog):
    """Both entry points on one damaged copy, the explicit path first: it stops before training and
    changes nothing in the store (asserted), so ``"last"`` then meets the same damage."""
    objects, states = template
    backend, proxy = s3_fault_proxy
    url = lightning_child.upload(objects, backend)
    options = backend.storage_options
    damaged = damage_payload(dataclasses.replace(backend, url=f"{url}/last.ckpt"), 2, "checkpoint.ckpt", kind)
    damaged_url = f"{url}/last.ckpt/{damaged}"
    damaged_size = _payload_size(objects, "last.ckpt")  # a flipped byte keeps the size

    # ckpt_path=<url>/last.ckpt: stops before training in one line naming the version, file and remedy
    before = _objects(backend)
    trainer, model, train, val, plugin, checkpoint = lightning_child.build(url, options, max_epochs=2)
    restored = []
    trainer.callbacks.append(lightning_child.loaded_states(restored))
    proxy.requests.clear()
    with pytest.raises(RAISED[kind]) as caught:
        trainer.fit(model, train, val, ckpt_path=f"{url}/last.ckpt")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{url}/last.ckpt version 2 (global_step 8) is damaged (")
    assert damaged_url in message and message.endswith(f"`opd-store delete {url}/last.ckpt 2`")
    # stopped before training: nothing trained, nothing saved, the damaged bytes never loaded
    assert restored == [] and trainer.global_step == 0
    assert _objects(backend) == before
    assert _payload_get_bytes(proxy) == ({"last.ckpt": damaged_size} if kind == "flip" else {})

    # ckpt_path="last": one row trains an epoch on (evictions after the resume); the others end where
    # they resume
    epochs = 3 if kind == "delete" else 2
    trainer, model, train, val, plugin, checkpoint = lightning_child.build(url, options, max_epochs=epochs)
    trainer.callbacks.append(lightning_child.loaded_states(restored))
    proxy.requests.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opd_store.integrations.lightning"):
        trainer.fit(model, train, val, ckpt_path="last")
    # resumed from the newest intact checkpoint, never from the damaged bytes
    (step, weights), = restored
    assert step == 8
    for name, tensor in states[FALLBACK]["state_dict"].items():
        assert torch.equal(weights[name], tensor), name
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "opd_store.integrations.lightning"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{url}: ckpt_path=\"last\" resumes from {url}/{FALLBACK} version 1 "
                                  f"(global_step 8); skipped the damaged {url}/last.ckpt version 2 "
                                  "(global_step 8) (")
    assert damaged_url in warnings[0]
    # each payload the resume read was downloaded once (the requests before the first save): the
    # damaged one only when the listing could not tell (a flipped byte), the loaded one once
    expected = {FALLBACK: _payload_size(objects, FALLBACK)}
    if kind == "flip":
        expected["last.ckpt"] = damaged_size
    assert _payload_get_bytes(proxy, until_first_put=True) == expected
    assert trainer.global_step == 4 * epochs
    if epochs == 3:
        # trained on, and top-k names evicted as in a run without a store: the best two remain (the
        # checkpoint "last" fell back to among them, tracked as any top-k name); the run used to
        # start from step 0 and leave four top-k names
        names = set(plugin.names()) - {"last.ckpt"}
        assert len(checkpoint.best_k_models) == 2
        assert names == {plugin.name_of(path) for path in checkpoint.best_k_models}
        assert FALLBACK in names
        newest = plugin.store_of(plugin.path_of("last.ckpt")).checkpoints()[-1]
        assert (newest.step, newest.metadata["global_step"]) == (3, 12)  # a version above the damaged one
        # the best model of the resumed run, as Lightning refers to it, loads from the store
        best = torch.load(plugin.open(checkpoint.best_model_path), weights_only=False)
        assert checkpoint.best_model_path.endswith(f"-step={best['global_step']}.ckpt")


def test_an_explicit_path_resume_downloads_its_payload_once(template, s3_fault_proxy):
    """An intact explicit ``ckpt_path``: the version is checked and loaded from one download."""
    objects, states = template
    backend, proxy = s3_fault_proxy
    url = lightning_child.upload(objects, backend)
    trainer, model, train, val, _plugin, _c = lightning_child.build(url, backend.storage_options, max_epochs=2)
    loaded = []
    trainer.callbacks.append(lightning_child.loaded_states(loaded))
    proxy.requests.clear()
    trainer.fit(model, train, val, ckpt_path=f"{url}/{FALLBACK}")
    (step, weights), = loaded
    assert step == trainer.global_step == 8
    assert all(torch.equal(weights[name], tensor) for name, tensor in states[FALLBACK]["state_dict"].items())
    assert _payload_get_bytes(proxy) == {FALLBACK: _payload_size(objects, FALLBACK)}


@pytest.mark.parametrize("how", ["remedy_followed", "killed_before_last"])
def test_last_without_a_last_version_resumes_from_the_newest_intact_checkpoint(how, template, moto_s3, caplog):
    """``fit(ckpt_path="last")`` when no ``last*.ckpt`` name holds a commit but top-k names do: after the
    damage message's remedy (``opd-store delete <url>/last.ckpt 2`` of the damaged version), or after a
    kill between the first top-k commit and the first ``last.ckpt`` commit. The run resumes from the
    newest intact checkpoint with one warning naming it, and its top-k names are evicted by the
    ``best_k_models`` that checkpoint restored (it used to start from step 0 silently and leave the
    earlier names beside ``-v1`` ones for good)."""
    objects, states = template
    backend = moto_s3.new_backend()
    options = backend.storage_options
    if how == "remedy_followed":
        url = lightning_child.upload(objects, backend)
        damage_payload(dataclasses.replace(backend, url=f"{url}/last.ckpt"), 2, "checkpoint.ckpt", "flip")
        assert cli_main(["delete", f"{url}/last.ckpt", "2", "--s3-endpoint-url", options["endpoint_url"],
                         "--storage-option", f"key={options['key']}", "--storage-option",
                         f"secret={options['secret']}"]) == 0
        resumed = FALLBACK
    else:  # the first run's only commit: epoch 0's top-k checkpoint
        resumed = "epoch=0-step=4.ckpt"
        url = lightning_child.upload({rel: data for rel, data in objects.items() if rel.startswith(resumed + "/")},
                                     backend)
    trainer, model, train, val, plugin, checkpoint = lightning_child.build(url, options, max_epochs=3)
    restored = []
    trainer.callbacks.append(lightning_child.loaded_states(restored))
    with caplog.at_level(logging.WARNING, logger="opd_store.integrations.lightning"):
        trainer.fit(model, train, val, ckpt_path="last")
    (step, weights), = restored
    assert step == states[resumed]["global_step"]
    assert all(torch.equal(weights[name], tensor) for name, tensor in states[resumed]["state_dict"].items())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "opd_store.integrations.lightning"]
    assert warnings == [(f"{url}: ckpt_path=\"last\" found no committed last*.ckpt checkpoint; resumes from "
                         f"{url}/{resumed} version 1 (global_step {step})")]
    assert trainer.global_step == 12
    # save_top_k=2 names, all tracked: no name of the first run beside them, no -v1 name
    names = set(plugin.names())
    assert names == {plugin.name_of(path) for path in checkpoint.best_k_models} | {"last.ckpt"}
    assert len(checkpoint.best_k_models) == 2 and not any("-v" in name for name in names)
    assert plugin.load_checkpoint(plugin.path_of("last.ckpt"))["global_step"] == 12
