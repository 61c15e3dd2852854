"""Checks that need a CUDA device: run on a GPU machine, prints one line per check and exits non-zero
on the first failure: optimizer state saved on one device loads onto the parameters' device and
the next step runs; an asynchronous save of CUDA state stages into pinned host memory.

    python -m bench.gpu_check [--out DIR]

1. ``cuda -> cpu``: the main job's student (PEFT LoRA) and AdamW trained two steps on ``cuda:0``,
   saved with ``save_opd_checkpoint``; a CPU-only student and optimizer load it: every optimizer
   state tensor lands on the CPU with the saved values, and the next step runs.
2. ``cpu -> cuda``: the same checkpoint loaded by a student on ``cuda:0``: state on ``cuda:0``,
   equal values, the next step runs and matches the CPU run's next step.
3. ``async pinned``: ``AsyncCheckpointer.save`` of the CUDA state stages into pinned host memory;
   parameters and optimizer state changed on the GPU right after the call do not reach the
   saved step (checked tensor by tensor against a copy taken before the change).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def _build(device: str):
    from opd_store.job import build_student, build_tokenizer

    tokenizer = build_tokenizer()
    student = build_student(len(tokenizer), seed=0).to(device)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return tokenizer, student, optimizer, scheduler


def _step(student, optimizer, scheduler, device: str) -> float:
    ids = torch.arange(2, 18, device=device).reshape(2, 8)
    loss = student(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().cpu())


class _Config:
    def fingerprint(self) -> str:
        return "gpu-check"

    def as_dict(self) -> dict:
        return {"gpu_check": True}


def _save_kwargs(store, student, tokenizer, optimizer, scheduler, step: int) -> dict:
    return dict(
        checkpoints_dir=store, model=student, processor=tokenizer, optimizer=optimizer, scheduler=scheduler,
        trainer_state={"attempted_updates": step, "successful_updates": step, "query_update": step},
        config=_Config(), provenance_fingerprints={"gpu": "1"}, teacher_state={"update_count": step},
    )


def _load(url: str, device: str):
    from opd_store.opd import load_adapter, load_opd_checkpoint

    tokenizer, student, optimizer, scheduler = _build(device)
    load_adapter(url, student)
    state = load_opd_checkpoint(
        url, optimizer=optimizer, scheduler=scheduler, config=_Config(), provenance_fingerprints={"gpu": "1"},
        teacher_state_loader=lambda teacher: None,
    )
    return student, optimizer, scheduler, state


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state_dict()["state"].values() for value in state.values()
            if isinstance(value, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the store (default: a temporary one)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    from opd_store import CheckpointStore
    from opd_store.opd import AsyncCheckpointer, save_opd_checkpoint

    root = Path(args.out or tempfile.mkdtemp(prefix="opd-gpu-check-"))
    store = CheckpointStore(root / "store")
    torch.manual_seed(0)
    tokenizer, student, optimizer, scheduler = _build("cuda")
    for _ in range(2):
        _step(student, optimizer, scheduler, "cuda")
    url = save_opd_checkpoint(**_save_kwargs(store, student, tokenizer, optimizer, scheduler, 2))
    saved = [t.detach().cpu().clone() for t in _optimizer_tensors(optimizer)]
    failures = 0

    for device in ("cpu", "cuda"):
        loaded_student, loaded_opt, loaded_sched, state = _load(url, device)
        tensors = _optimizer_tensors(loaded_opt)
        moment_tensors = [t for t in tensors if t.dim() > 0]
        on_device = all(t.device.type == device for t in moment_tensors)
        equal = len(tensors) == len(saved) and all(torch.equal(a.cpu(), b) for a, b in zip(tensors, saved))
        loss = _step(loaded_student, loaded_opt, loaded_sched, device)
        ok = on_device and equal and state["successful_updates"] == 2 and loss == loss
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} cuda -> {device}: {len(moment_tensors)} moment tensors on "
              f"{sorted({t.device.type for t in moment_tensors})}, values equal={equal}, next step loss={loss:.6f}")

    before = {name: p.detach().cpu().clone() for name, p in student.named_parameters() if p.requires_grad}
    moments_before = [t.detach().cpu().clone() for t in _optimizer_tensors(optimizer)]
    with AsyncCheckpointer(pin_memory=True) as checkpointer:
        handle = checkpointer.save(**_save_kwargs(store, student, tokenizer, optimizer, scheduler, 3))
        with torch.no_grad():  # training goes on at once: change every trainable tensor on the GPU
            for p in student.parameters():
                if p.requires_grad:
                    p.add_(1.0)
            for t in _optimizer_tensors(optimizer):
                if t.dim() > 0:
                    t.mul_(3.0)
        async_url = handle.result(timeout_secs=300)
    loaded_student, loaded_opt, _, _ = _load(async_url, "cpu")
    after = {name: p.detach() for name, p in loaded_student.named_parameters() if p.requires_grad}
    params_equal = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    moments_equal = all(torch.equal(a, b) for a, b in zip(moments_before, _optimizer_tensors(loaded_opt)))
    ok = params_equal and moments_equal
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} async pinned: blocked {handle.blocked_secs * 1e3:.1f} ms for "
          f"{handle.staged_bytes} staged bytes; saved adapter equal to pre-change={params_equal}, "
          f"optimizer moments equal={moments_equal}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
