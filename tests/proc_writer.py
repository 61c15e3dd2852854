"""A separate writer/reader process for race, freshness and kill tests.

Two ways to run it, same commands and messages:

* ``python tests/proc_writer.py BACKEND_JSON COMMAND [ARGS...]`` (stdin/stdout lines; handy by
  hand), where BACKEND_JSON is ``Backend.to_json()`` (:mod:`opd_testkit.stores`);
* :func:`start` (used by the tests): a ``multiprocessing`` child forked from a ``forkserver``
  that has already imported opd_store, s3fs and gcsfs, talking over a ``Pipe``. Each child is a
  separate process with its own store instance, clients and caches; only the import cost is
  shared (it is several seconds per interpreter on a loaded 2-core machine).

Synchronisation with the parent is by messages, never by sleeping. Every command sends its result
as one JSON object (the last message):

``save STEP TAG [--wait-before-commit]``
    Save STEP with the payloads :func:`payloads_for` (TAG) and commit. With
    ``--wait-before-commit``: write every payload, send ``ready``, block until the parent sends a
    line, then commit (a barrier: the parent releases all racers at once). Result:
    ``{"outcome": "committed"|"conflict", "attempt_id": ..., "error": ...}``.
``delete STEP``
    Delete STEP.
``observe``
    Open one store instance, send ``ready``, then answer each line ``query S1,S2,...`` with
    ``{"steps": [...], "latest": N|null, "complete": {"S": bool}}`` using that same instance.
``stream STEP TAG``
    Begin STEP, stream the first MiB of a payload, send ``streaming``, block (the parent
    SIGKILLs it there, mid-payload).
``partial STEP TAG``
    Begin STEP, write and close ``model.pt``, send ``model-done``, block before writing
    ``optimizer.pt`` (the parent SIGKILLs it there).
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opd_testkit.stores import Backend, use_emulator_environment  # noqa: E402

use_emulator_environment()  # before fsspec's S3/GCS backends are imported

PAYLOAD_NAMES = ("model.pt", "optimizer.pt", "nested/dir/extra.bin")
PRELOAD = ["proc_writer", "opd_testkit.stores", "opd_store", "fsspec", "s3fs", "gcsfs"]


def make_bytes(tag: str, size: int) -> bytes:
    """Deterministic bytes of ``size`` for ``tag`` (differs between tags in every block; a prefix of
    the same tag's longer bytes; SHAKE-256's output, made in C: several processes of a test make
    the same megabytes, which a Python loop over SHA-256 blocks made slowly)."""
    return hashlib.shake_256(tag.encode()).digest(size)


def payloads_for(tag: str) -> dict[str, bytes]:
    """The payloads a writer tagged ``tag`` saves (same names and sizes for every tag)."""
    return {name: make_bytes(f"{tag}/{name}", 4096 + 1000 * i) for i, name in enumerate(PAYLOAD_NAMES)}


# -- channels ------------------------------------------------------------------------------------


class _StdioChannel:
    def say(self, text: str) -> None:
        print(text, flush=True)

    def emit(self, obj) -> None:
        print(json.dumps(obj), flush=True)

    def wait(self) -> str | None:
        line = sys.stdin.readline()
        return line if line else None


class _PipeChannel:
    def __init__(self, conn) -> None:
        self.conn = conn

    def say(self, text: str) -> None:
        self.conn.send(text)

    def emit(self, obj) -> None:
        self.conn.send(json.dumps(obj))

    def wait(self) -> str | None:
        try:
            return self.conn.recv()
        except EOFError:
            return None


# -- commands ------------------------------------------------------------------------------------


def _store(backend: Backend):
    from opd_store import CheckpointStore

    return CheckpointStore(backend.url, storage_options=backend.storage_options)


def cmd_save(chan, backend: Backend, step: int, tag: str, wait: bool) -> None:
    from opd_store import CommitConflictError

    store = _store(backend)
    try:
        txn = store.begin(step, metadata={"tag": tag})
    except CommitConflictError as exc:
        if wait:
            chan.say("ready")
            chan.wait()
        chan.emit({"outcome": "conflict", "attempt_id": None, "error": type(exc).__name__, "at": "begin"})
        return
    for name, data in payloads_for(tag).items():
        txn.write_bytes(name, data)
    if wait:
        chan.say("ready")
        chan.wait()
    try:
        txn.commit()
    except CommitConflictError as exc:
        chan.emit({"outcome": "conflict", "attempt_id": txn.attempt_id, "error": type(exc).__name__, "at": "commit",
                   "is_file_exists": isinstance(exc, FileExistsError)})
        return
    chan.emit({"outcome": "committed", "attempt_id": txn.attempt_id, "error": None})


def cmd_delete(chan, backend: Backend, step: int) -> None:
    _store(backend).delete(step)
    chan.emit({"deleted": step})


def cmd_observe(chan, backend: Backend) -> None:
    from opd_store import CheckpointNotFoundError

    store = _store(backend)
    chan.say("ready")
    while True:
        line = chan.wait()
        words = (line or "quit").split()
        if not words:
            continue
        if words[0] == "quit":
            break
        asked = [int(s) for s in words[1].split(",")] if len(words) > 1 else []
        try:
            latest = store.latest_step()
        except CheckpointNotFoundError:
            latest = None
        chan.emit({"steps": store.steps(), "latest": latest, "complete": {str(s): store.is_complete(s) for s in asked}})
    chan.emit({"done": True})


def cmd_stream(chan, backend: Backend, step: int, tag: str) -> None:
    store = _store(backend)
    txn = store.begin(step)
    writer = txn.open("model.pt")
    writer.write(make_bytes(tag, 1 << 20))
    writer.flush()
    chan.say("streaming")
    chan.wait()  # killed here
    writer.write(make_bytes(tag + "-rest", 1 << 20))
    writer.close()
    txn.commit()


def cmd_partial(chan, backend: Backend, step: int, tag: str) -> None:
    store = _store(backend)
    txn = store.begin(step)
    payloads = payloads_for(tag)
    txn.write_bytes("model.pt", payloads["model.pt"])
    txn.settle()  # model.pt published (a remote store finishes uploads in the background)
    chan.say("model-done")
    chan.wait()  # killed here
    txn.write_bytes("optimizer.pt", payloads["optimizer.pt"])
    txn.commit()


def run(chan, backend_json: str, command: str, args: list[str]) -> None:
    backend = Backend.from_json(backend_json)
    if command == "save":
        cmd_save(chan, backend, int(args[0]), args[1], "--wait-before-commit" in args)
    elif command == "delete":
        cmd_delete(chan, backend, int(args[0]))
    elif command == "observe":
        cmd_observe(chan, backend)
    elif command == "stream":
        cmd_stream(chan, backend, int(args[0]), args[1])
    elif command == "partial":
        cmd_partial(chan, backend, int(args[0]), args[1])
    else:
        raise SystemExit(f"unknown command {command}")


def _child(conn, backend_json: str, command: str, args: list[str]) -> None:
    chan = _PipeChannel(conn)
    try:
        run(chan, backend_json, command, args)
    except BaseException:
        conn.send(json.dumps({"child_error": traceback.format_exc()}))
        raise SystemExit(1)
    finally:
        conn.close()


_CONTEXT = None


def context():
    """The ``forkserver`` multiprocessing context, its server preloaded with the heavy imports."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def start(backend_json: str, command: str, *args: str):
    """Start a child running ``command``; return ``(process, parent end of the pipe)``."""
    ctx = context()
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_child, args=(child, backend_json, command, list(args)), daemon=True)
    process.start()
    child.close()
    return process, parent


def main(argv: list[str]) -> None:
    run(_StdioChannel(), argv[0], argv[1], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
