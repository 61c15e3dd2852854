"""One start of the tiny TRL GKD run, as its own program (forked from the worker's fork server).

``python tests/integrations/trl_child.py SPEC_JSON``, started by :func:`start` in a fresh machine
(:func:`opd_store.job._machines.fresh_machine`: new empty working directory, ``HOME`` and temp
dir, so only the store carries state from one start to the next). The fork server has imported
torch, transformers, TRL and opd_store's integrations (:data:`opd_testkit.forkserver.TRAINER_PRELOAD`),
so a start costs a fork instead of ~10 s of imports on a loaded 2-core machine.

Events (:mod:`opd_testkit.events`): every event of :func:`opd_store.job._trl_demo.run_start`
(``resumed``, ``step``, ``saved``); with ``step_ack`` the child waits for the parent's reply after
each ``step`` event, so the parent can SIGKILL it at an exact step; at the end
``{"event": "done", "cwd_entries": [...]}`` after ``torch.save`` of the final state (adapter,
optimizer, losses, step) to the spec's ``result`` path, or ``{"event": "error", "traceback": ...}``.
The callback journals a ``progress`` event after every update, so ``opd-store report`` knows
exactly where a start was killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from opd_testkit import events, forkserver

from opd_store.job._machines import fresh_machine
from opd_store.job._trl_demo import GKDSpec

SPEC = GKDSpec(max_steps=4, save_steps=2)
"""The run of every start: saves at steps 2 and 4 (the test kills one start at step 3 and one
during the save of step 4)."""


def main(spec: dict) -> None:
    try:
        import torch

        from opd_store.job._trl_demo import run_start

        def on_event(event):
            events.emit(event)
            if spec["step_ack"] and event["event"] == "step":
                events.wait_reply()

        state = run_start(spec["store_url"], "out", storage_options=spec["storage_options"], events=on_event,
                          async_upload=spec["async_upload"], spec=SPEC, journal_progress_secs=0)
        state.pop("log_history", None)
        torch.save(state, spec["result"])
        events.emit({"event": "done", "cwd_entries": sorted(os.listdir("."))})
    except BaseException:  # noqa: BLE001 - reported to the parent
        events.emit({"event": "error", "traceback": traceback.format_exc()})
        raise


def start(base: Path, store_url: str, storage_options: dict, *, async_upload: bool = False, step_ack: bool = True):
    """Start one training start on a fresh machine under ``base``; return ``(EventStream, machine
    directory)`` (its ``home/``, ``tmp/``, ``work/`` and the ``result.pt`` of a start that ended)."""
    env, work = fresh_machine(base)
    spec = dict(store_url=store_url, storage_options=storage_options, async_upload=async_upload, step_ack=step_ack,
                result=str(work.parent / "result.pt"))
    process = forkserver.popen([sys.executable, __file__, json.dumps(spec)], env=env, cwd=work, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return events.EventStream(process), work.parent


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
