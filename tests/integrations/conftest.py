"""tests/integrations: one forkserver preload for every child process these tests start.

The trainer children (``trl_child``, ``lightning_child``, ``rank_child``) are forked from the
shared forkserver of ``tests/proc_writer.py``. Its preload list counts only when it is set before
the server starts, and in a full (xdist) run a core process test usually starts it first. Setting
the union of what every child imports here, when this directory is collected (before any test
runs), makes each child start cost a fork instead of 5-15 s of torch/transformers/TRL/Lightning
imports, whichever test starts the server. Modules that are not installed are skipped by the
forkserver (``ImportError`` is ignored there).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import proc_writer  # noqa: E402

PRELOAD = [
    *proc_writer.PRELOAD, "torch", "transformers", "accelerate", "peft", "datasets", "trl", "trl.experimental.gkd",
    "lightning", "lightning.pytorch", "opd_store.job.trl_demo", "opd_store.integrations.transformers",
    "opd_store.integrations.lightning", "trl_child", "lightning_child", "rank_child",
]

proc_writer.context().set_forkserver_preload(PRELOAD)
