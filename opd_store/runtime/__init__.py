"""The process a save runs in: exit hooks that run while background I/O still works
(:mod:`._exit_hooks`), spot preemption notices (:mod:`._preemption`), background threads kept off
the training thread's ``random`` stream (:mod:`._thread_random`), the rule for every duration
option (:mod:`._seconds`) and the soak's kill points
(``kill_points``: test-only, inert unless ``OPD_STORE_KILL_POINT`` arms one)."""

from . import _kill_points as kill_points
from ._exit_hooks import register as register_exit_hook
from ._preemption import AWS_METADATA_ENDPOINT, GCE_METADATA_ENDPOINT, SIGNAL_NAMES, PreemptionNotice, PreemptionWatcher
from ._seconds import check_secs, secs_problem
from ._thread_random import register_io_thread, route_background_random

__all__ = ["AWS_METADATA_ENDPOINT", "GCE_METADATA_ENDPOINT", "SIGNAL_NAMES", "PreemptionNotice", "PreemptionWatcher",
           "check_secs", "kill_points", "register_exit_hook", "register_io_thread", "route_background_random", "secs_problem"]
