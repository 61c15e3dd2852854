"""tests/integrations: every test trains with one torch intra-op thread.

The trainers here are tiny: their matrix products gain nothing from a second thread, and on a
loaded 2-core machine (one pytest-xdist worker per core) OpenMP threads waiting for each other cost
5-10x the wall time and CPU of one thread (a 4-step GKD run: 5-10 s and 2-3 CPU-seconds with 2
threads, 0.7 s and 0.4 CPU-seconds with 1). The trainer programs the tests start set the same
(``opd_store.job._trl_demo.run_start``, ``lightning_child.py``, ``rank_child.py``), so in-process
and child runs compute the same bits. The worker's own setting is restored after each test; the
shared runs (session fixtures, set up before this one) use
:func:`opd_store.job._machines.torch_threads` themselves.
"""

from __future__ import annotations

import pytest

from opd_store.job._machines import torch_threads


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield
