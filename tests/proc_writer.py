"""A separate writer/reader process for race, freshness and kill tests.

Usage: ``python tests/proc_writer.py BACKEND_JSON COMMAND [ARGS...]``, where BACKEND_JSON is
``Backend.to_json()`` from ``tests/backends.py``. Every command prints its result as one JSON line
(the last line of stdout). Synchronisation with the parent is by lines over stdin/stdout, never by
sleeping:

``save STEP TAG [--wait-before-commit]``
    Save STEP with the payloads :func:`payloads_for` (TAG) and commit. With
    ``--wait-before-commit``: write every payload, print ``ready``, block until a line arrives on
    stdin, then commit (a barrier: the parent releases all racers at once). Prints
    ``{"outcome": "committed"|"conflict", "attempt_id": ..., "error": ...}``.
``delete STEP``
    Delete STEP.
``observe``
    Open one store instance, then answer each stdin line ``query S1,S2,...`` with
    ``{"steps": [...], "latest": N|null, "complete": {"S": bool}}`` using that same instance.
``stream STEP TAG``
    Begin STEP, stream the first chunk of a payload, print ``streaming``, block on stdin (the
    parent SIGKILLs it there, mid-payload).
``partial STEP TAG``
    Begin STEP, write and close ``model.pt``, print ``model-done``, block on stdin before writing
    ``optimizer.pt`` (the parent SIGKILLs it there).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import Backend  # noqa: E402  (sets the emulator environment before fsspec imports)

PAYLOAD_NAMES = ("model.pt", "optimizer.pt", "nested/dir/extra.bin")


def make_bytes(tag: str, size: int) -> bytes:
    """Deterministic bytes of ``size`` for ``tag`` (differs between tags in every block)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{tag}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def payloads_for(tag: str) -> dict[str, bytes]:
    """The payloads a writer tagged ``tag`` saves (same names and sizes for every tag)."""
    return {name: make_bytes(f"{tag}/{name}", 4096 + 1000 * i) for i, name in enumerate(PAYLOAD_NAMES)}


def _store(backend: Backend):
    from opd_store import CheckpointStore

    return CheckpointStore(backend.url, storage_options=backend.storage_options)


def _emit(obj) -> None:
    print(json.dumps(obj), flush=True)


def cmd_save(backend: Backend, step: int, tag: str, wait: bool) -> None:
    from opd_store import CommitConflictError

    store = _store(backend)
    try:
        txn = store.begin(step, metadata={"tag": tag})
    except CommitConflictError as exc:
        if wait:
            print("ready", flush=True)
            sys.stdin.readline()
        _emit({"outcome": "conflict", "attempt_id": None, "error": type(exc).__name__, "at": "begin"})
        return
    for name, data in payloads_for(tag).items():
        txn.write_bytes(name, data)
    if wait:
        print("ready", flush=True)
        sys.stdin.readline()
    try:
        txn.commit()
    except CommitConflictError as exc:
        _emit({"outcome": "conflict", "attempt_id": txn.attempt_id, "error": type(exc).__name__, "at": "commit",
               "is_file_exists": isinstance(exc, FileExistsError)})
        return
    _emit({"outcome": "committed", "attempt_id": txn.attempt_id, "error": None})


def cmd_delete(backend: Backend, step: int) -> None:
    _store(backend).delete(step)
    _emit({"deleted": step})


def cmd_observe(backend: Backend) -> None:
    from opd_store import CheckpointNotFoundError

    store = _store(backend)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        asked = [int(s) for s in words[1].split(",")] if len(words) > 1 else []
        try:
            latest = store.latest_step()
        except CheckpointNotFoundError:
            latest = None
        _emit({"steps": store.steps(), "latest": latest, "complete": {str(s): store.is_complete(s) for s in asked}})
    _emit({"done": True})


def cmd_stream(backend: Backend, step: int, tag: str) -> None:
    store = _store(backend)
    txn = store.begin(step)
    writer = txn.open("model.pt")
    writer.write(make_bytes(tag, 1 << 20))
    writer.flush()
    print("streaming", flush=True)
    sys.stdin.readline()  # killed here
    writer.write(make_bytes(tag + "-rest", 1 << 20))
    writer.close()
    txn.commit()


def cmd_partial(backend: Backend, step: int, tag: str) -> None:
    store = _store(backend)
    txn = store.begin(step)
    payloads = payloads_for(tag)
    txn.write_bytes("model.pt", payloads["model.pt"])
    print("model-done", flush=True)
    sys.stdin.readline()  # killed here
    txn.write_bytes("optimizer.pt", payloads["optimizer.pt"])
    txn.commit()


def main(argv: list[str]) -> None:
    backend = Backend.from_json(argv[0])
    command, args = argv[1], argv[2:]
    if command == "save":
        cmd_save(backend, int(args[0]), args[1], "--wait-before-commit" in args)
    elif command == "delete":
        cmd_delete(backend, int(args[0]))
    elif command == "observe":
        cmd_observe(backend)
    elif command == "stream":
        cmd_stream(backend, int(args[0]), args[1])
    elif command == "partial":
        cmd_partial(backend, int(args[0]), args[1])
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
