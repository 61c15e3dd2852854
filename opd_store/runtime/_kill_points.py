"""Kill points: SIGKILL this process at one exact point of the job, for the soak (test-only).

The soak (``bench/soak.py``) proves that a job killed anywhere resumes bit-exactly. A kill drawn by
the clock lands where the process spends its time (start-up, idle), not where the guarantees are
tested (a payload half streamed, a manifest not yet created, a step half deleted). So the job
calls :func:`reach` (and :func:`payload_bytes`, :func:`update_started`) at the points that matter,
and the soak arms exactly one of them per process start through the environment variable
:data:`ENV_VAR`, a JSON object:

==================  ==========================================================================
``phase``           where to die (below)
``attempted``       ``forward``/``backward``/``optimizer_step``/``between_updates``: the job's
                    attempted-update number (1-based, counted over the whole run) to die in or
                    just before
``call``            ``forward``/``backward``: die at this hook call (1-based) within that update
``step``            save phases: the checkpoint step whose save to die in
``name``/``byte``   payload phases: die once ``byte`` bytes of payload ``name`` were written
``object``          ``retention_delete``: 0 once retention decided to delete, before the first
                    step's delete; 1 after that step's manifest is deleted, before its payloads
``rank``            die only on this rank (``torch.distributed``); default every rank (single rank)
``report``          a file to which the kill appends one JSON line (phase, thread, details)
                    before the signal, so the soak can tell a kill at the armed point from a miss
==================  ==========================================================================

Phases: ``forward``, ``backward`` and ``optimizer_step`` (inside an update: a module's forward
call, a module's backward call, right after ``optimizer.step()`` before the scheduler and the
counters moved), ``between_updates`` (after the previous update, its log record and its save,
before the next update), ``payload_stream`` (a synchronous save's payload on the main thread),
``async_write`` (an asynchronous save's payload on its background worker), ``tier_upload`` (a
payload copied to the bucket by a tiered store's upload worker), ``before_manifest`` (every
payload published, the manifest not yet created), ``after_commit`` (the manifest created, before
the after-commit hooks, the retention pass and the job's ``saved`` event), ``retention_delete``.

Zero cost when the variable is unset: each call checks one module global (the environment is read
once, at the first call, so a process forked from a preloaded parent sees its own environment).
Nothing here is meant for production: the variable exists for the soak, the demo (``opd-store demo``
kills its first spot start between two updates, so it knows where the job died) and their tests.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any, Callable

ENV_VAR = "OPD_STORE_KILL_POINT"
"""The environment variable that arms a kill point (a JSON object, see the module docstring)."""

PHASES = ("forward", "backward", "optimizer_step", "between_updates", "payload_stream", "before_manifest",
          "after_commit", "retention_delete", "tier_upload", "async_write")
"""Every phase a kill can be armed at."""

# Which thread writes the payloads of each payload phase (thread names from pipeline/_worker.py's
# users: opd/_async_save.py names its worker "opd-async-save-...", tiered/_uploads.py "opd-store-upload-...").
_PAYLOAD_THREADS = {"payload_stream": "MainThread", "async_write": "opd-async-save-", "tier_upload": "opd-store-upload-"}

_UNREAD = object()
_plan: Any = _UNREAD  # None: not armed (the common case); else the plan dict
_state = {"calls": 0}  # torch hook calls seen in the armed update
_hooks: list[Any] = []


def _armed() -> dict[str, Any] | None:
    global _plan
    if _plan is _UNREAD:
        text = os.environ.get(ENV_VAR)
        _plan = json.loads(text) if text else None
        if _plan is not None and _plan.get("phase") not in PHASES:
            raise ValueError(f"{ENV_VAR}: unknown phase {_plan.get('phase')!r} (one of {', '.join(PHASES)})")
    return _plan


def _on_this_rank(plan: dict[str, Any]) -> bool:
    if plan.get("rank") is None:
        return True
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return rank == plan["rank"]


def _die(plan: dict[str, Any], **details: Any) -> None:
    """Record the kill (one JSON line, ``O_APPEND``) and SIGKILL this process: no handler, no
    ``finally``, no flush runs, as when a spot VM is reclaimed."""
    if plan.get("report"):
        record = {"phase": plan["phase"], "thread": threading.current_thread().name, "pid": os.getpid(), **details}
        fd = os.open(plan["report"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def update_started(attempted: int) -> None:
    """The training loop is about to attempt update ``attempted`` (1-based over the run).

    Dies here for ``between_updates``; for the phases inside an update, installs torch's global
    hooks for the duration of this update (removed when the next one starts).
    """
    plan = _armed()
    if plan is None:
        return
    for handle in _hooks:
        handle.remove()
    _hooks.clear()
    if plan.get("attempted") != attempted or not _on_this_rank(plan):
        return
    phase = plan["phase"]
    if phase == "between_updates":
        _die(plan, attempted=attempted)
    if phase not in ("forward", "backward", "optimizer_step"):
        return
    from torch.nn.modules.module import register_module_forward_pre_hook, register_module_full_backward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _state["calls"] = 0

    def counted(*_args: Any) -> None:
        _state["calls"] += 1
        if _state["calls"] >= plan.get("call", 1):
            _die(plan, attempted=attempted, call=_state["calls"])

    if phase == "forward":
        _hooks.append(register_module_forward_pre_hook(lambda module, args: counted()))
    elif phase == "backward":
        _hooks.append(register_module_full_backward_pre_hook(lambda module, grad_output: counted()))
    else:
        _hooks.append(register_optimizer_step_post_hook(lambda optimizer, args, kwargs: counted()))


def payload_bytes(step: int, name: str, offset: int, view: memoryview, write: Callable[[memoryview], Any]) -> None:
    """A payload writer is about to write ``view`` at byte ``offset`` of payload ``name``.

    When the armed byte falls in this write (on the phase's thread), writes the bytes before it
    with ``write`` and dies.
    """
    plan = _armed()
    if plan is None:
        return
    thread = _PAYLOAD_THREADS.get(plan["phase"])
    if (thread is None or plan.get("step") != step or plan.get("name") != name
            or not threading.current_thread().name.startswith(thread) or not _on_this_rank(plan)):
        return
    target = int(plan.get("byte", 0))
    if offset <= target < offset + view.nbytes:
        if target > offset:
            write(view[:target - offset])
        _die(plan, step=step, name=name, byte=target)


def reach(point: str, *, step: int | None = None) -> None:
    """The job reached ``point``: ``before_manifest`` or ``after_commit`` of ``step``'s commit (on
    this thread), ``retention_pass`` (retention is about to delete ``step``, the oldest it
    deletes) or ``step_delete`` (``step``'s manifest is deleted, its payloads not yet)."""
    plan = _armed()
    if plan is None:
        return
    phase = plan["phase"]
    if point in ("before_manifest", "after_commit"):
        if (phase == point and plan.get("step") == step and threading.current_thread() is threading.main_thread()
                and _on_this_rank(plan)):
            _die(plan, step=step)
    elif phase == "retention_delete" and _on_this_rank(plan):
        index = ("retention_pass", "step_delete").index(point)
        if index == plan.get("object", 0):
            _die(plan, step=step, object=index)


__all__ = ["ENV_VAR", "PHASES", "payload_bytes", "reach", "update_started"]
