"""A writer whose clock is wrong, for the garbage-collection clock tests (``test_gc_clock.py``).

``python tests/retention/skewed_writer.py BACKEND_JSON MODE CLOCK_OFFSET_SECS [LOCAL_TIER_DIR]``

Before anything else it shifts this process's ``time.time()`` by ``CLOCK_OFFSET_SECS`` (a VM
restored from a snapshot, a container whose host has not synced its clock): the attempt ids it
makes carry that time, as a real skewed writer's would; the store stamps its objects with its own
clock. opd_store reads the clock through ``time.time()`` at each call, so the shift holds in a new
interpreter and in a child of the tests' fork server (which imported opd_store before) alike. Messages go to stdout, one per line, flushed; the parent synchronises on them and answers
on stdin, never by sleeping:

``txn``
    Begin step 2, write ``a.bin`` (published), stream 6 MiB of ``b.bin`` (on S3 with a 5 MiB upload
    block: one part uploaded, the multipart upload open), wait until all of that is stored (a.bin's
    background publish settled, the part's ``UploadPart`` answered), print ``paused <attempt id>``, wait for a
    line, finish ``b.bin``, commit, print ``committed <attempt id>``. The parent may SIGKILL it
    while it waits (an abandoned attempt).
``async``
    An asynchronous save (``AsyncCheckpointer``) of step 2 of a tiny PEFT student whose background
    writer blocks at its first write into ``training_state.pt``: print ``paused``, wait for a
    line, wait for the save, print ``committed <attempt id>``.
``tier``
    A tiered save of step 2 (local tier ``LOCAL_TIER_DIR``, bucket ``BACKEND_JSON``) whose upload
    to the bucket blocks at its first write into ``b.bin``: print ``paused``, wait for a line,
    flush the upload, print ``committed <bucket attempt id>``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_real_time = time.time
_offset_secs = float(sys.argv[3])
time.time = lambda: _real_time() + _offset_secs  # the writer's clock, wrong by the offset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import threading  # noqa: E402

from opd_testkit.stores import Backend  # noqa: E402
from proc_writer import make_bytes  # noqa: E402

from opd_store import CheckpointStore  # noqa: E402
from opd_store.testing import Fault, FaultyStorage  # noqa: E402

STEP = 2
A_BYTES = make_bytes("a", 1000)
B_BYTES = make_bytes("b", 7 << 20)
STREAMED_FIRST = 6 << 20


def say(message: str) -> None:
    print(message, flush=True)


def gated(store: CheckpointStore, name: str) -> CheckpointStore:
    """``store``, whose first write into a payload called ``name`` prints ``paused`` and waits for
    a line on stdin."""
    gate = threading.Lock()
    passed: list[bool] = []

    def wait_at_gate(op) -> bool:
        if op.kind == "write" and op.rel.endswith(name):
            with gate:
                if not passed:
                    say("paused")
                    sys.stdin.readline()
                    passed.append(True)
        return False

    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=wait_at_gate, once=False)))


def parts_stored(store: CheckpointStore) -> threading.Semaphore:
    """Released once per multipart part the S3 server has stored (botocore ``after-call`` of
    ``UploadPart`` on the store's own client); never released on other backends, whose writes are
    stored when ``write`` returns."""
    stored = threading.Semaphore(0)
    if store.storage.url_root.startswith("s3://"):
        store.storage.fs.connect()
        store.storage.fs.s3.meta.events.register("after-call.s3.UploadPart", lambda **_kw: stored.release())
    return stored


def run_txn(store: CheckpointStore) -> None:
    # The parent judges what the store holds at "paused" (and, killing the writer there, what it
    # keeps): everything written before it must have landed by then. Payloads publish in the
    # background and parts upload in flight, so the writer waits for them: a.bin's publish
    # (settle) and, on S3, b.bin's first part (stored by the server, not merely handed over).
    stored = parts_stored(store)
    txn = store.begin(STEP)
    txn.write_bytes("a.bin", A_BYTES)
    txn.settle()
    with txn.open("b.bin") as writer:
        writer.write(B_BYTES[:STREAMED_FIRST])
        if store.storage.url_root.startswith("s3://") and not stored.acquire(timeout=120):
            raise SystemExit("b.bin's first part was not stored within 120 s")
        say(f"paused {txn.attempt_id}")
        sys.stdin.readline()
        writer.write(B_BYTES[STREAMED_FIRST:])
    txn.commit()
    say(f"committed {txn.attempt_id}")


def run_async(store: CheckpointStore) -> None:
    from opd_testkit import opd as fixtures

    from opd_store.opd import AsyncCheckpointer

    factory = fixtures.PeftFactory()
    model, tokenizer = factory.model(), factory.tokenizer()
    optimizer, scheduler = factory.train(model, steps=2)
    checkpointer = AsyncCheckpointer()
    handle = checkpointer.save(
        checkpoints_dir=gated(store, "training_state.pt"), model=model, processor=tokenizer, optimizer=optimizer,
        scheduler=scheduler, trainer_state=fixtures.trainer_state(STEP), config=fixtures.TinyConfig(),
        provenance_fingerprints=dict(fixtures.PROVENANCE), teacher_state={"update_count": STEP})
    handle.result()
    checkpointer.close()
    say(f"committed {store.manifest(STEP).attempt_id}")


def run_tier(backend: Backend, local_dir: str) -> None:
    from opd_store.tiered import TieredStore

    bucket = CheckpointStore(backend.url, storage_options=backend.storage_options)
    with TieredStore(local_dir, gated(bucket, "b.bin")) as store:
        with store.begin(STEP) as txn:
            txn.write_bytes("a.bin", A_BYTES)
            txn.write_bytes("b.bin", B_BYTES)
        store.flush()
    say(f"committed {bucket.manifest(STEP).attempt_id}")


def main() -> None:
    backend, mode = Backend.from_json(sys.argv[1]), sys.argv[2]
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    if mode == "txn":
        run_txn(store)
    elif mode == "async":
        run_async(store)
    elif mode == "tier":
        run_tier(backend, sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
