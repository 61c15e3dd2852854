"""Test-only fault injection for spawned ranks of ``opd-store train --nproc N``.

Spawned ranks are fresh interpreters, so a test cannot patch them; this module is put on
``PYTHONPATH`` by tests/distributed/test_train_nproc.py only. With
``OPD_TEST_BLOCK_SAVE=<rank>:<step>:<marker path>`` set, rank ``<rank>`` blocks forever in the
middle of writing its RNG part of step ``<step>`` after writing its pid to the marker file (the
test then SIGKILLs it). Without the variable it does nothing.
"""

import os

_SPEC = os.environ.get("OPD_TEST_BLOCK_SAVE")
if _SPEC:
    import threading

    from opd_store.opd import _save as _checkpoint  # where the payload writes live

    _rank, _step, _marker = _SPEC.split(":", 2)
    _original = _checkpoint._save_torch

    def _blocking_save_torch(txn, name, obj):
        if txn.rank == int(_rank) and txn.step == int(_step) and name == f"rng-rank-{int(_rank):02d}.pt":
            with txn.open(name) as writer:
                writer.write(b"partial payload bytes")
                with open(_marker, "w") as handle:
                    handle.write(str(os.getpid()))
                threading.Event().wait()
        return _original(txn, name, obj)

    _checkpoint._save_torch = _blocking_save_torch
