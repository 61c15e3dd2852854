"""Resume state: random streams, data order, LR schedules,
counters and optimizer placement come back exactly after an OPD checkpoint round trip, on every
backend (local, memory, S3 on moto's server, GCS on fake-gcs-server; which test runs where: the
comment above ``LOCAL_AND_MEMORY``)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from opd_store.errors import UnsafeCheckpointError
from opd_store.job._train import warmup_decay
from opd_store.opd import LoaderPosition

from .helpers import VOCAB, adapter_tensors, base_state, load, save, seed_all, student, trainable

# -- 21: random streams at an epoch boundary -----------------------------------------------------

STEPS_PER_EPOCH = 3


# Every test saves and loads the same OPD checkpoint payloads (trainer state, optimizer, scheduler,
# RNG); what differs between them is the state, not how it reaches a store. The RNG streams, the
# schedules (cosine), the optimizer's placement and a refused save run on all four backends; the
# tests marked LOCAL_AND_MEMORY prove their state on a file store and memory:// only.
LOCAL_AND_MEMORY = ["local", "memory"]


def _make_optim(model):
    optimizer = torch.optim.AdamW(trainable(model), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=9, eta_min=1e-4)
    return optimizer, scheduler


def _run_epochs(model, optimizer, scheduler, epochs: range, on_epoch_end=None) -> list[dict]:
    """Train ``epochs``; each step draws from Python, numpy and torch, runs dropout and records
    every draw, every dropout output and the loss."""
    records: list[dict] = []
    outputs: list[torch.Tensor] = []
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert dropouts, "the student must have active dropout"
    hooks = [m.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone())) for m in dropouts]
    model.train()
    try:
        for epoch in epochs:
            for index in range(STEPS_PER_EPOCH):
                outputs.clear()
                draws = (random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(3).tobytes())
                ids = torch.randint(0, VOCAB, (2, 6))
                loss = model(input_ids=ids, labels=ids).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                records.append({
                    "epoch": epoch, "index": index, "draws": draws, "ids": ids.tolist(),
                    "dropout": [o for o in outputs], "loss": loss.item(), "lr": optimizer.param_groups[0]["lr"],
                })
            if on_epoch_end is not None:
                on_epoch_end(epoch, len(records))
    finally:
        for hook in hooks:
            hook.remove()
    return records


def _same_records(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x["epoch"], x["index"], x["draws"], x["ids"], x["loss"], x["lr"]) == (
            y["epoch"], y["index"], y["draws"], y["ids"], y["loss"], y["lr"]
        ), (x["epoch"], x["index"])
        assert len(x["dropout"]) == len(y["dropout"]) > 0
        for p, q in zip(x["dropout"], y["dropout"]):
            assert torch.equal(p, q), (x["epoch"], x["index"])


def test_epoch_boundary_resume_draws_the_same_numbers(store):
    """Save at an epoch boundary; the resumed run draws the same Python, numpy and
    torch random numbers (Gaussian caches included), the same dropout masks and the same losses
    as the uninterrupted run."""
    seed_all(7)
    model = student(dropout=0.2)
    reference = _run_epochs(model, *_make_optim(model), range(3))
    reference_adapter = adapter_tensors(model)

    # The interrupted run: identical up to its save at the end of epoch 1, then the machine is gone.
    seed_all(7)
    model = student(dropout=0.2)
    optimizer, scheduler = _make_optim(model)
    urls = []

    def save_at_boundary(epoch: int, steps: int) -> None:
        if epoch == 1:
            urls.append(save(store, model=model, optimizer=optimizer, scheduler=scheduler,
                             trainer_state=base_state(steps, epoch=epoch + 1)))

    first_leg = _run_epochs(model, optimizer, scheduler, range(2), on_epoch_end=save_at_boundary)
    _same_records(first_leg, reference[: 2 * STEPS_PER_EPOCH])  # saving drew nothing from any stream

    # A new process: other RNG states, fresh model, optimizer and scheduler.
    seed_all(12345)
    model = student(dropout=0.2)
    optimizer, scheduler = _make_optim(model)
    state = load(urls[0], model=model, optimizer=optimizer, scheduler=scheduler,
                 storage_options=store.storage_options)
    assert state["epoch"] == 2 and state["successful_updates"] == 2 * STEPS_PER_EPOCH
    resumed = _run_epochs(model, optimizer, scheduler, range(state["epoch"], 3))
    _same_records(resumed, reference[2 * STEPS_PER_EPOCH:])
    for name, tensor in adapter_tensors(model).items():
        assert torch.equal(tensor, reference_adapter[name]), name


# -- 22: shuffled DataLoader, saved mid-epoch 2 --------------------------------------------------


class NoisyRange(Dataset):
    """Items ``i`` with a random "augmentation" drawn from the global torch RNG in ``__getitem__``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return torch.tensor(index), torch.rand(())


EPOCHS, DATASET_SIZE, BATCH = 3, 20, 4  # 5 batches per epoch
SAVE_AT = (1, 2)  # epoch index 1 (the second epoch), after its 2nd batch


def _loader(generator: torch.Generator, num_workers: int = 0) -> DataLoader:
    return DataLoader(NoisyRange(DATASET_SIZE), batch_size=BATCH, shuffle=True, generator=generator,
                      num_workers=num_workers)


def _data_run(model, optimizer, position, loader, *, stop_at=None, on_save=None) -> list[tuple]:
    seen = []
    for epoch in range(position.epoch, EPOCHS):
        for indices, noise in position.iterate(loader, epoch):
            ids = (indices[:, None] + torch.arange(6)) % VOCAB
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append((epoch, indices.tolist(), noise.numpy().tobytes(), loss.item()))
            if (epoch, position.batches_done) == stop_at:
                on_save(position.state_dict(), len(seen))
                return seen
    return seen


@pytest.mark.parametrize("backend", LOCAL_AND_MEMORY, indirect=True)
def test_shuffled_loader_resumed_mid_epoch_sees_the_same_batches(store):
    """A shuffled DataLoader over three epochs, saved mid-epoch 2 with
    ``LoaderPosition.state_dict()`` in ``trainer_state``: the resumed run sees the same batches
    (indices, the dataset's random augmentation, losses)."""
    _loader_resume(store, num_workers=0)


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
def test_shuffled_loader_with_workers_resumed_mid_epoch(store):
    """A shuffled DataLoader resumed mid-epoch with two worker processes (their seeds come from the
    loader's generator): the resumed run sees the same batches and the same worker-side random
    augmentation. One backend: the store's part is the same as in the test above."""
    _loader_resume(store, num_workers=2)


def _loader_resume(store, num_workers: int) -> None:
    seed_all(3)
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.02)
    generator = torch.Generator().manual_seed(11)
    reference = _data_run(model, optimizer, LoaderPosition(generator), _loader(generator, num_workers))
    assert len(reference) == EPOCHS * DATASET_SIZE // BATCH
    orders = [[i for _e, batch, _n, _l in reference if _e == e for i in batch] for e in range(EPOCHS)]
    assert all(sorted(order) == list(range(DATASET_SIZE)) for order in orders) and orders[0] != orders[1]

    seed_all(3)
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(11)
    saved = {}

    def on_save(position_state, steps):
        saved["url"] = save(store, model=model, optimizer=optimizer, scheduler=scheduler,
                            trainer_state=base_state(steps, data_position=position_state))
        saved["steps"] = steps

    first = _data_run(model, optimizer, LoaderPosition(generator), _loader(generator, num_workers),
                      stop_at=SAVE_AT, on_save=on_save)
    assert first == reference[: saved["steps"]] and saved["steps"] == 5 + 2

    seed_all(999)
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(424242)  # whatever seed: the position restores it
    state = load(saved["url"], model=model, optimizer=optimizer, scheduler=scheduler,
                 storage_options=store.storage_options)
    assert state["data_position"]["epoch"] == 1 and state["data_position"]["batches_done"] == 2
    assert type(state["data_position"]["batches_done"]) is int
    position = LoaderPosition(generator)
    position.load_state_dict(state["data_position"])
    resumed = _data_run(model, optimizer, position, _loader(generator, num_workers))
    assert resumed == reference[saved["steps"]:]


def test_naive_loader_resume_sees_other_batches():
    """Control for the mid-epoch loader resume: restoring only the global RNGs and skipping
    batches, without the loader generator's epoch-start state, gives another order, so the saved
    position matters."""
    generator = torch.Generator().manual_seed(11)
    position = LoaderPosition(generator)
    loader = _loader(generator)
    batches = [[b[0].tolist() for b in position.iterate(loader, epoch)] for epoch in range(2)]
    naive_generator = torch.Generator().manual_seed(11)  # the run's seed, but not the epoch start
    naive = [b[0].tolist() for b in _loader(naive_generator)]
    assert naive[2:] != batches[1][2:]


def test_loader_position_refuses_a_loader_without_its_generator():
    """A loader that shuffles from the global torch RNG cannot be resumed
    mid-epoch, so the helper refuses it instead of replaying another order."""
    position = LoaderPosition(torch.Generator().manual_seed(0))
    loader = DataLoader(NoisyRange(8), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="generator= this LoaderPosition's generator"):
        next(position.iterate(loader, 0))
    with pytest.raises(ValueError, match="epoch_start_generator_state"):
        position.load_state_dict({"epoch": 0, "batches_done": 1, "epoch_start_generator_state": torch.zeros(3)})


# -- 23: LR schedules ----------------------------------------------------------------------------

K = 4


def _schedulers():
    def cosine(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-5)

    def warmup_cosine_lambda(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay(2, 10))

    def sequential(opt):
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8, eta_min=1e-5)
        return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])

    def restarts(opt):
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=1e-5)

    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.01], total_steps=12, anneal_strategy="cos")

    return {f.__name__: f for f in (cosine, warmup_cosine_lambda, sequential, restarts, one_cycle)}


SCHEDULERS = _schedulers()


def _two_group_optimizer(model):
    params = trainable(model)
    return torch.optim.AdamW([{"params": params[::2], "lr": 0.03}, {"params": params[1::2], "lr": 0.007}])


def _steps(model, optimizer, scheduler, count: int, generator: torch.Generator) -> list[list[float]]:
    lrs = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (2, 6), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return lrs


# The scheduler kinds differ in their state dict, not in how it reaches a store: they run on
# memory://, and the save and load of a scheduler's state on local, S3 and GCS is
# test_cosine_lr_matches_the_closed_form_after_resume's (and test_epoch_boundary_resume_...'s).
@pytest.mark.parametrize("backend", ["memory"], indirect=True)
@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_schedule_rebuilt_after_load_gives_the_same_lr(store, kind):
    """A cosine-shaped schedule saved at step k; the optimizer and scheduler are
    rebuilt from scratch and loaded: the LR of every param group at k+1 (and after) equals the
    uninterrupted run's exactly, for chainable (recursive) and closed-form schedulers."""
    build = SCHEDULERS[kind]
    model = student()
    optimizer = _two_group_optimizer(model)
    scheduler = build(optimizer)
    generator = torch.Generator().manual_seed(5)
    _steps(model, optimizer, scheduler, K, generator)
    url = save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(K))
    data_state = generator.get_state()
    expected = _steps(model, optimizer, scheduler, 4, generator)
    expected_last = scheduler.get_last_lr()

    model = student()
    optimizer = _two_group_optimizer(model)
    scheduler = build(optimizer)  # rebuilt: its constructor sets step-0 LRs, the load must override them
    load(url, model=model, optimizer=optimizer, scheduler=scheduler, storage_options=store.storage_options)
    generator = torch.Generator()
    generator.set_state(data_state)
    got = _steps(model, optimizer, scheduler, 4, generator)
    assert got == expected  # exact float equality, k+1 first
    assert scheduler.get_last_lr() == expected_last
    assert len({lr for lrs in expected for lr in lrs}) > 2  # the schedule really moves


def test_cosine_lr_matches_the_closed_form_after_resume(store):
    """After resuming a CosineAnnealingLR at k, the LR at k+1 is the closed form
    eta_min + (base - eta_min) * (1 + cos(pi * (k+1) / T_max)) / 2 (to float rounding)."""
    model = student()
    optimizer = torch.optim.SGD(trainable(model), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.001)
    generator = torch.Generator().manual_seed(1)
    _steps(model, optimizer, scheduler, K, generator)
    url = save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(K))
    model = student()
    optimizer = torch.optim.SGD(trainable(model), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.001)
    assert optimizer.param_groups[0]["lr"] == 0.1
    load(url, model=model, optimizer=optimizer, scheduler=scheduler, storage_options=store.storage_options)
    (lr,) = _steps(model, optimizer, scheduler, 1, generator)[0:1][0]
    closed = 0.001 + (0.1 - 0.001) * (1 + math.cos(math.pi * (K + 1) / 10)) / 2
    assert lr == pytest.approx(closed, rel=1e-12, abs=0)
    assert lr != 0.1


# -- 24: counters --------------------------------------------------------------------------------

COUNTERS = {
    "global_step": 123_457,
    "teacher_updates": 17,
    "tokens_seen": 2**53 + 1,  # not representable as a float64: any float detour changes it
    "bytes_seen": 2**70 + 3,  # beyond int64
    "negative_offset": -(2**63) - 5,
    "zero": 0,
    "done": False,
}


@pytest.mark.parametrize("backend", LOCAL_AND_MEMORY, indirect=True)
def test_counters_round_trip_as_plain_ints(store):
    """Counters kept as plain ints (global step, teacher updates, tokens seen, ints
    beyond float64 and int64 precision) round-trip exactly with type int; bools stay bools; numpy
    integer counters come back as the equal Python int; nothing is dropped."""
    model = student()
    optimizer, scheduler = _make_optim(model)
    trainer = base_state(
        12, **COUNTERS, np_counter=np.int64(2**62 + 3), np_small=np.uint8(200),
        per_rank_tokens=[2**53 + 1, 2**53 + 3], nested={"epoch": 2, 7: "int key", (1, 2): "tuple key"},
    )
    url = save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=trainer,
               teacher_state={"update_count": 12, "teacher_updates": 2**53 + 1})
    model = student()
    optimizer, scheduler = _make_optim(model)
    state = load(url, model=model, optimizer=optimizer, scheduler=scheduler, storage_options=store.storage_options)
    assert set(state) == set(trainer)
    for key, value in COUNTERS.items():
        assert state[key] == value and type(state[key]) is type(value), key
    assert state["np_counter"] == 2**62 + 3 and type(state["np_counter"]) is int
    assert state["np_small"] == 200 and type(state["np_small"]) is int
    assert state["per_rank_tokens"] == [2**53 + 1, 2**53 + 3]
    assert state["nested"] == {"epoch": 2, 7: "int key", (1, 2): "tuple key"}
    manifest = store.manifest(12)
    assert manifest.metadata["successful_updates"] == 12 and type(manifest.metadata["attempted_updates"]) is int


class _Hook:
    def __call__(self):
        return None


UNSAVABLE = [
    ("trainer", "callbacks", lambda: None, "trainer_state['callbacks']"),
    ("trainer", "extra", {"sampler": _Hook()}, "trainer_state['extra']['sampler']"),
    ("trainer", "history", [1, 2, iter([3])], "trainer_state['history'][2]"),
    ("teacher", "cache", {"lock": __import__("threading").Lock()}, "teacher_state['cache']['lock']"),
]


# The refusal comes before the save opens its transaction, whatever the value: every value on
# memory://, and the first one on every other backend (nothing reaches local disk, S3 or GCS).
@pytest.mark.parametrize(
    ("backend", "where", "state_key", "value", "named"),
    [("memory", *row) for row in UNSAVABLE] + [(name, *UNSAVABLE[0]) for name in ("local", "s3", "gcs")],
    indirect=["backend"],
)
def test_unsavable_state_value_is_refused_with_its_key(store, backend, where, state_key, value, named):
    """A state value that cannot be saved is refused at save time with its key path
    named, never dropped; nothing at all is written to the store."""
    model = student()
    optimizer, scheduler = _make_optim(model)
    trainer = base_state(3)
    teacher = {"update_count": 3}
    (trainer if where == "trainer" else teacher)[state_key] = value
    with pytest.raises(UnsafeCheckpointError) as caught:
        save(store, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state=trainer, teacher_state=teacher)
    assert str(caught.value).startswith(named + " holds a ")
    assert store.steps() == [] and store.checkpoints() == []
    fs = backend.raw_fs()
    root = backend.raw_root()
    assert not fs.exists(root) or fs.find(root) == []


# -- 28: optimizer state onto the parameters' device and dtype ------------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _adamw_on(params, fused: bool):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, fused=fused or None)


def _trained_float64(fused: bool):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3).double()
    optimizer = _adamw_on(list(layer.parameters()), fused)
    for _ in range(3):
        loss = layer(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return layer, optimizer


class _LayerModel:
    """``save_pretrained`` of a plain layer's weights (safetensors), as ``model`` for the save."""

    def __init__(self, layer) -> None:
        self.layer = layer

    def save_pretrained(self, directory: str) -> None:
        from pathlib import Path

        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.layer.state_dict().items()},
                  f"{directory}/adapter_model.safetensors")


# The fused kernel changes where the state lands, not how it reaches a store: fused on memory://,
# unfused on every backend.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("backend", "fused"), [(name, False) for name in ("local", "memory", "s3", "gcs")]
                         + [("memory", True)], indirect=["backend"])
def test_optimizer_state_lands_on_the_params_device_and_dtype(store, device, fused):
    """AdamW state saved from float64 CPU parameters loads onto float32 parameters
    on ``device`` (CPU always; CUDA too where available): every moment tensor takes the
    parameter's device and dtype, the values are the saved ones cast, and the next step runs
    and equals loading the same state dict in memory (no store)."""
    layer, optimizer = _trained_float64(fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    saved_state = optimizer.state_dict()
    url = save(store, model=_LayerModel(layer), optimizer=optimizer, scheduler=scheduler, trainer_state=base_state(3))

    def fresh():
        target = torch.nn.Linear(4, 3).to(device=device, dtype=torch.float32)
        with torch.no_grad():
            for p, q in zip(target.parameters(), layer.parameters()):
                p.copy_(q.to(torch.float32))
        opt = _adamw_on(list(target.parameters()), fused)
        return target, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    target, opt, sched = fresh()
    from opd_store.opd import load_opd_checkpoint

    from .helpers import PROVENANCE, config

    load_opd_checkpoint(url, optimizer=opt, scheduler=sched, config=config(), provenance_fingerprints=dict(PROVENANCE),
                        teacher_state_loader=lambda s: None, storage_options=store.storage_options)
    for index, param in enumerate(target.parameters()):
        state = opt.state[param]
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name].device == param.device and state[name].dtype == torch.float32
            assert torch.equal(state[name].cpu(), saved_state["state"][index][name].to(torch.float32))
        expected_step_device = param.device if fused else torch.device("cpu")
        assert state["step"].device == expected_step_device and float(state["step"]) == 3.0

    reference, ref_opt, _ = fresh()
    ref_opt.load_state_dict(saved_state)
    for model_, opt_ in ((target, opt), (reference, ref_opt)):
        x = torch.linspace(-1, 1, 20, device=device).reshape(5, 4)
        loss = model_(x).pow(2).sum()
        opt_.zero_grad()
        loss.backward()
        opt_.step()
    for p, q, before in zip(target.parameters(), reference.parameters(), layer.parameters()):
        assert torch.equal(p, q)
        assert not torch.equal(p.detach().cpu(), before.detach().to(torch.float32))  # the step moved it
        assert torch.isfinite(p).all()


_TAG_CUDA = {"on": False}


def _cuda_tagger(obj):
    """A torch serialization location tag: ``cuda:0`` for CPU storages while enabled (what a
    checkpoint saved on a GPU records), so a CPU-only host can produce a GPU-tagged payload."""
    if _TAG_CUDA["on"] and getattr(obj, "device", None) is not None and obj.device.type == "cpu":
        return "cuda:0"
    return None


def _never(obj, location):
    return None


torch.serialization.register_package(1, _cuda_tagger, _never)


@pytest.mark.parametrize("backend", LOCAL_AND_MEMORY, indirect=True)
@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_state_saved_on_gpu_loads_on_this_host(store, device):
    """A checkpoint whose tensors were saved on ``cuda:0`` (the payload records that
    location) loads on a host without CUDA: payloads are mapped to the CPU first, and the
    optimizer state then lands on the parameters' device; the next step runs."""
    layer, optimizer = _trained_float64(False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _TAG_CUDA["on"] = True
    try:
        url = save(store, model=_LayerModel(layer), optimizer=optimizer, scheduler=scheduler,
                   trainer_state=base_state(3, device_tensor=torch.ones(2)))
    finally:
        _TAG_CUDA["on"] = False
    assert b"cuda:0" in store.read(3, "training_state.pt")  # the payload really records a GPU location
    target = torch.nn.Linear(4, 3).to(device=device, dtype=torch.float64)
    opt = torch.optim.AdamW(list(target.parameters()), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    from opd_store.opd import load_opd_checkpoint

    from .helpers import PROVENANCE, config

    state = load_opd_checkpoint(url, optimizer=opt, scheduler=sched, config=config(),
                                provenance_fingerprints=dict(PROVENANCE), teacher_state_loader=lambda s: None,
                                storage_options=store.storage_options)
    assert state["device_tensor"].device.type == "cpu"
    for param in target.parameters():
        assert opt.state[param]["exp_avg"].device == param.device
    loss = target(torch.ones(2, 4, device=device, dtype=torch.float64)).sum()
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in target.parameters())
