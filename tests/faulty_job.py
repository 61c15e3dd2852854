"""``opd-store`` with test-only faults for the ranks of ``train --nproc N`` (tests/dcp/test_train_shard.py,
tests/distributed/test_train_nproc.py).

``python tests/faulty_job.py train ...`` applies the faults its environment names, then runs
``python -m opd_store train ...`` in this process. The ranks are forked from it
(``--start-method fork``), so they inherit the patches; the test cannot patch them otherwise.

With ``OPD_TEST_BLOCK_DCP_SAVE=<rank>:<step>:<marker path>`` (``--shard``), rank ``<rank>`` writes
part of its first DCP file of step ``<step>``, writes its pid to the marker file and blocks forever
(the test SIGKILLs it there).

With ``OPD_TEST_BLOCK_SAVE=<rank>:<step>:<marker path>`` (replicated ranks), rank ``<rank>`` does
the same in the middle of writing its RNG part ``rng-rank-<rank>.pt`` of step ``<step>``.
"""

import os
import runpy
import threading


def _fault(variable: str) -> tuple[int, int, str] | None:
    """``(rank, step or update, marker path)`` from ``variable``'s ``<rank>:<n>:<marker>``, or ``None``."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    rank, number, marker = spec.split(":", 2)
    return int(rank), int(number), marker


def _mark(marker: str) -> None:
    """Tell the test where this rank is: its pid in ``marker``."""
    with open(marker, "w") as handle:
        handle.write(str(os.getpid()))


_SPEC = _fault("OPD_TEST_BLOCK_DCP_SAVE")
if _SPEC:
    from opd_store.dcp import StoreWriter

    _rank, _step, _marker = _SPEC
    _original = StoreWriter.write_data

    def _blocking_write_data(self, plan, planner):
        if self.rank == _rank and self.step == _step:
            part = self.store.begin_part(self.step, attempt_id=plan.storage_data.attempt_id, rank=self.rank,
                                         world_size=plan.storage_data.world_size)
            writer = part.open(f"__{self.rank}_0.distcp")
            writer.write(b"partial shard bytes")
            writer.flush()
            _mark(_marker)
            threading.Event().wait()
        return _original(self, plan, planner)

    StoreWriter.write_data = _blocking_write_data

_BLOCK = _fault("OPD_TEST_BLOCK_SAVE")
if _BLOCK:
    from opd_store.opd import _save as _checkpoint  # where the payload writes live

    _block_rank, _block_step, _block_marker = _BLOCK
    _save_torch = _checkpoint._save_torch

    def _blocking_save_torch(txn, name, obj):
        if txn.rank == _block_rank and txn.step == _block_step and name == f"rng-rank-{_block_rank:02d}.pt":
            with txn.open(name) as writer:
                writer.write(b"partial payload bytes")
                _mark(_block_marker)
                threading.Event().wait()
        return _save_torch(txn, name, obj)

    _checkpoint._save_torch = _blocking_save_torch

# With ``OPD_TEST_PAUSE_AFTER_UPDATE=<rank>:<attempted update>:<marker path>``, rank ``<rank>``
# writes its pid to the marker after that update and waits for a signal (the test sends SIGTERM to
# it alone), so the notice is certain to arrive before the next update boundary.
_PAUSE = _fault("OPD_TEST_PAUSE_AFTER_UPDATE")
if _PAUSE:
    import signal

    import opd_store.job._train as _train

    _pause_rank, _pause_update, _pause_marker = _PAUSE
    _run_update = _train.run_sharded_update
    _calls = []

    def _pausing_update(**kwargs):
        outcome = _run_update(**kwargs)
        _calls.append(1)
        import torch.distributed as dist

        if dist.get_rank() == _pause_rank and len(_calls) == _pause_update:
            _mark(_pause_marker)
            signal.pause()  # returns once the preemption watcher's handler ran
        return outcome

    _train.run_sharded_update = _pausing_update

runpy.run_module("opd_store", run_name="__main__", alter_sys=True)
