"""A child process for the asynchronous-save kill and exit tests (run by tests/spot/test_async_save.py).

``python tests/spot/async_child.py BACKEND_JSON OUT_DIR MODE``; messages go to stdout, one per
line, flushed, so the parent synchronises on them (never on time):

``kill``
    Train a tiny PEFT student 2 updates, save step 2 synchronously, ``torch.save`` the state the
    save was called with to ``OUT_DIR/expected.pt``, train 2 more updates, start an asynchronous
    save of step 4 whose upload blocks inside ``training_state.pt`` after printing ``uploading``
    (the parent SIGKILLs it there).
``exit-commit``
    Start an asynchronous save of step 2 and return from main at once (print ``returning``):
    the atexit hook must wait for the commit.
``exit-stuck``
    Start an asynchronous save of step 2 whose upload never finishes, with
    ``exit_timeout_secs=0.25``, and return from main: the hook must abandon it uncommitted.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from opd_testkit import opd as fixtures  # noqa: E402
from opd_testkit.stores import Backend  # noqa: E402

from opd_store import CheckpointStore  # noqa: E402
from opd_store.opd import (
    AsyncCheckpointer,  # noqa: E402
    save_opd_checkpoint,  # noqa: E402
)
from opd_store.opd._rng import capture_rng_state  # noqa: E402
from opd_store.testing import Fault, FaultyStorage  # noqa: E402


def say(message: str) -> None:
    print(message, flush=True)


def kwargs_for(store, model, tokenizer, optimizer, scheduler, successful: int) -> dict:
    return dict(
        checkpoints_dir=store, model=model, processor=tokenizer, optimizer=optimizer, scheduler=scheduler,
        trainer_state=fixtures.trainer_state(successful), config=fixtures.TinyConfig(),
        provenance_fingerprints=dict(fixtures.PROVENANCE),
        teacher_state={"update_count": successful, "ema": torch.arange(3.0)},
    )


def blocking_storage(store: CheckpointStore, message: str, name: str) -> CheckpointStore:
    """The store, with its first write into ``name`` announcing ``message`` and then blocking forever."""
    never = threading.Event()

    def block(op) -> bool:
        if op.kind == "write" and op.rel.endswith(name):
            say(message)
            never.wait()
        return False

    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=block, once=False)))


def main() -> None:
    backend, out_dir, mode = Backend.from_json(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    factory = fixtures.PeftFactory()
    model, tokenizer = factory.model(), factory.tokenizer()
    optimizer, scheduler = factory.train(model, steps=2)
    if mode == "kill":
        rng = capture_rng_state()
        expected = {
            "adapter": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng,
        }
        save_opd_checkpoint(**kwargs_for(store, model, tokenizer, optimizer, scheduler, 2))
        torch.save(expected, out_dir / "expected.pt")
        more_optimizer, more_scheduler = factory.train(model, steps=2, seed=11)
        checkpointer = AsyncCheckpointer()
        blocked = blocking_storage(store, "uploading", "training_state.pt")
        checkpointer.save(**kwargs_for(blocked, model, tokenizer, more_optimizer, more_scheduler, 4))
        threading.Event().wait()  # the parent kills this process
    elif mode in ("exit-commit", "exit-stuck"):
        target = store if mode == "exit-commit" else blocking_storage(store, "uploading", "training_state.pt")
        checkpointer = AsyncCheckpointer(exit_timeout_secs=60 if mode == "exit-commit" else 0.25)
        checkpointer.save(**kwargs_for(target, model, tokenizer, optimizer, scheduler, 2))
        say("returning")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
