"""A child process that ends while a background save or upload is in flight (run by
tests/spot/test_exit_paths.py, forked from the preloaded fork server).

``python tests/spot/exit_child.py BACKEND_JSON LOCAL_TIER_DIR PATH [ORDER]``; messages go to
stdout, one per line, flushed. Every path saves step 2 with the small real OPD objects of
:mod:`opd_testkit.opd` (tensors in the snapshot) and must end with exit status 0 and step 2
committed (for the tier paths: durable in the bucket), with no thread of opd_store alive when the
``atexit`` hooks run (printed as ``threads at exit: [...]``, just before the interpreter
finalizes). The commit point of the save (the manifest
create, in the store or in the bucket) waits at a gate, so the save is provably in flight when the
process starts to end:

``async-exit``
    An :class:`AsyncCheckpointer` save, then return from the program. The gate opens when
    opd_store's exit hook announces on stderr that it waits for the save, so the save commits
    while the interpreter is exiting and the hook stops waiting the moment it has committed (the
    race that ended such processes with SIGABRT).
``tier-exit``
    The same through a :class:`TieredStore` whose bucket upload waits at the gate; the gate opens
    from an exit hook registered after the store's (:func:`opd_store.runtime._exit_hooks.register`; hooks
    run last-registered first), so the upload finishes while the interpreter is exiting.
``async-tier-exit``
    An :class:`AsyncCheckpointer` save into a :class:`TieredStore` whose *local* commit waits at
    the gate, opened as for ``async-exit``: the save commits locally while the interpreter exits,
    and its commit queues the upload, which the store's upload worker must still accept and run.
    ``ORDER`` (``checkpointer-first`` or ``store-first``) is the order the two are made in; the
    exit routine must finish the save before the store's upload worker either way.
``async-sigterm`` / ``tier-sigterm``
    A :class:`PreemptionWatcher` handles SIGTERM; the gate opens when the notice arrives. The child
    prints ``in-flight``, the parent sends SIGTERM, the child (as the main job does on a notice)
    waits for the save or upload, prints ``committed``, and returns.
"""

from __future__ import annotations

import atexit
import faulthandler
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opd_testkit.opd import save_kwargs  # noqa: E402
from opd_testkit.stores import Backend, open_store  # noqa: E402

from opd_store import CheckpointStore, TieredStore
from opd_store.opd import (
    AsyncCheckpointer,  # noqa: E402
    save_opd_checkpoint,  # noqa: E402
)
from opd_store.runtime import PreemptionWatcher  # noqa: E402
from opd_store.runtime import _exit_hooks as exit_hooks  # noqa: E402
from opd_store.testing import Fault, FaultyStorage  # noqa: E402

STEP = 2
# A teacher whose EMA weights are parameters: the snapshot holds new nn.Parameter objects over the
# staged copies, and the writer thread frees them (each free releases and re-takes the GIL inside
# torch) after the save is done, as a real adapter's or teacher's state makes it do.
EMA_PARAMETERS = 512


def kwargs(store) -> dict:
    return save_kwargs(store, successful=STEP, teacher_state={
        "update_count": STEP,
        "ema": [torch.nn.Parameter(torch.full((4,), float(i))) for i in range(EMA_PARAMETERS)],
    })


def say(message: str) -> None:
    print(message, flush=True)


def gated(store: CheckpointStore, gate: threading.Event) -> CheckpointStore:
    """``store`` whose manifest create (the commit point) waits until ``gate`` is set."""

    def wait_at_commit(op) -> bool:
        if op.kind == "create":
            gate.wait()
        return False

    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=wait_at_commit, once=False)))


class _OpenGateOn:
    """``sys.stderr`` that sets ``gate`` once ``text`` has been written through it."""

    def __init__(self, stream, text: str, gate: threading.Event) -> None:
        self._stream, self._text, self._gate = stream, text, gate

    def write(self, data: str) -> int:
        count = self._stream.write(data)
        if self._text in data:
            self._stream.flush()
            self._gate.set()
        return count

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def report_threads_at_exit() -> None:
    """An ``atexit`` hook: these run after opd_store's exit hooks and before the interpreter
    finalizes; none of opd_store's threads may be alive by then."""
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("opd-") and t.is_alive())
    say(f"threads at exit: {alive}")


def main() -> None:
    faulthandler.enable()  # the test's watchdog SIGABRTs a stuck child: print every thread first
    atexit.register(report_threads_at_exit)
    backend, local_dir, path = Backend.from_json(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    store = open_store(backend)
    gate = threading.Event()
    watcher = PreemptionWatcher(signals=("SIGTERM",)).start() if path.endswith("-sigterm") else None
    checkpointer = None
    if path == "async-tier-exit":
        made = []
        for what in ("checkpointer", "store") if sys.argv[4] == "checkpointer-first" else ("store", "checkpointer"):
            made.append(AsyncCheckpointer(exit_timeout_secs=300) if what == "checkpointer" else
                        TieredStore(gated(CheckpointStore(local_dir), gate), store, exit_timeout_secs=300))
        checkpointer, tiered = made if isinstance(made[0], AsyncCheckpointer) else made[::-1]
        checkpointer.save(**kwargs(tiered))
    elif path.startswith("async-"):
        checkpointer = AsyncCheckpointer(exit_timeout_secs=300)
        checkpointer.save(**kwargs(gated(store, gate)))
    elif path.startswith("tier-"):
        tiered = TieredStore(local_dir, gated(store, gate), exit_timeout_secs=300)
        save_opd_checkpoint(**kwargs(tiered))
    else:
        raise SystemExit(f"unknown path {path}")
    if path in ("async-exit", "async-tier-exit"):
        sys.stderr = _OpenGateOn(sys.stderr, "opd_store: waiting up to", gate)
    elif path == "tier-exit":
        exit_hooks.register(gate.set)  # runs before the store's exit hook: the interpreter is exiting
    if watcher is None:
        say("returning")
        return
    say("in-flight")
    # Wait in slices: CPython runs a signal handler only when the main thread executes bytecode,
    # and a signal the kernel delivers to another thread does not wake a main thread blocked in an
    # untimed wait (the main job checks should_checkpoint_now() between updates instead).
    while not watcher.wait(0.05):
        pass
    watcher.stop()  # its signal thread ends with it, as a user's ``with PreemptionWatcher()`` does
    gate.set()
    if checkpointer is not None:
        checkpointer.close()
    else:
        tiered.flush()
    say(f"committed {watcher.notice.source}")


if __name__ == "__main__":
    main()
