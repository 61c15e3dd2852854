"""``opd-store train`` that loses its machine in the middle of uploading a checkpoint.

Usage: ``python killed_train.py KILL_STEP KILL_AFTER_PAYLOADS -- TRAIN_ARGS...``

Runs the real main job (``opd_store.cli.main(["train", ...])``) and, once ``KILL_AFTER_PAYLOADS``
payload objects of the save of step ``KILL_STEP`` are fully uploaded (closed, and published: a
remote store finishes an upload in the background, so the attempt is settled first), SIGKILLs its
own process:
the checkpoint is then partly uploaded (some payload objects in the store, the rest and the
manifest never written), as when a spot instance is reclaimed mid-save. Prints
``KILLING <step> <payloads>`` on stderr first.
"""

from __future__ import annotations

import os
import signal
import sys

from opd_store.cli import main
from opd_store.commit import _attempt as attempt
from opd_store.commit import _transaction as transaction


def _install(kill_step: int, kill_after: int) -> None:
    original = transaction.PayloadWriter.close
    original_open = attempt.Attempt.open
    owners: dict[int, attempt.Attempt] = {}
    closed: list[str] = []

    def open_(self, name):
        writer = original_open(self, name)
        owners[id(writer)] = self
        return writer

    def close(self) -> None:
        was_open = not self.closed
        original(self)
        if was_open and self.step == kill_step:
            owners[id(self)].settle()  # every payload closed so far is published
            closed.append(self.name)
            if len(closed) >= kill_after:
                print(f"KILLING {kill_step} {len(closed)} {','.join(closed)}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    transaction.PayloadWriter.close = close
    attempt.Attempt.open = open_


if __name__ == "__main__":
    kill_step, kill_after, sep, *train_args = sys.argv[1:]
    assert sep == "--", "usage: killed_train.py KILL_STEP KILL_AFTER_PAYLOADS -- TRAIN_ARGS..."
    _install(int(kill_step), int(kill_after))
    sys.exit(main(["train", *train_args]))
