"""One start of the tiny TRL GKD run in its own process, forked from a preloaded forkserver.

The forkserver has imported torch, transformers, TRL, PEFT, datasets, s3fs and opd_store once
(``tests/integrations/conftest.py`` sets its preload list), so a start costs a fork instead of ~10 s
of imports on a loaded 2-core machine. Each child is a separate process: before it builds anything it moves into a
new empty working directory and points ``HOME`` and the temp dir at new empty directories (a fresh
machine: only the store carries state from one start to the next).

Messages to the parent (a ``Pipe``), each a dict: every event of
:func:`opd_store.job.trl_demo.run_start` (``resumed``, ``step``, ``saved``); after a ``step`` event
the child waits for the parent's reply (``"go"``), so the parent can SIGKILL it at an exact step;
at the end ``{"event": "done", "state": final_state}`` or ``{"event": "error", "traceback": ...}``.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import proc_writer  # noqa: E402  (the forkserver context shared with the other process tests)

from opd_store.job.trl_demo import GKDSpec  # noqa: E402

SPEC = GKDSpec(max_steps=4, save_steps=2)
"""The run of every start: saves at steps 2 and 4 (the test kills one start at step 3 and one
during the save of step 4)."""



def _fresh_machine(machine: str) -> None:
    root = Path(machine)
    for sub in ("home", "tmp", "work"):
        (root / sub).mkdir(parents=True)
    os.chdir(root / "work")
    os.environ["HOME"] = str(root / "home")
    os.environ["TMPDIR"] = str(root / "tmp")
    tempfile.tempdir = None  # recomputed from TMPDIR on next use


def _child(conn, machine: str, store_url: str, storage_options: dict, async_upload: bool, step_ack: bool) -> None:
    try:
        _fresh_machine(machine)
        import torch

        from opd_store.job.trl_demo import run_start

        def events(event):
            conn.send(event)
            if step_ack and event["event"] == "step":
                conn.recv()

        state = run_start(store_url, "out", storage_options=storage_options, events=events, async_upload=async_upload,
                          spec=SPEC)
        state.pop("log_history", None)
        buffer = io.BytesIO()  # plain bytes: torch's pickler would pass tensors as shared-memory fds
        torch.save(state, buffer)
        conn.send({"event": "done", "state": buffer.getvalue(), "cwd_entries": sorted(os.listdir("."))})
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send({"event": "error", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def start(machine: str, store_url: str, storage_options: dict, *, async_upload: bool = False, step_ack: bool = True):
    """Start one training start in a new process; return ``(process, parent end of the pipe)``."""
    ctx = proc_writer.context()
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_child, args=(child, machine, store_url, storage_options, async_upload, step_ack),
                          daemon=True)
    process.start()
    child.close()
    return process, parent
