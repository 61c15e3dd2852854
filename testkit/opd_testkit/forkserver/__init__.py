"""Start Python programs as new processes forked from a parent that has already imported them.

A test that starts ``python -m opd_store train ...`` pays an interpreter start and the imports of
torch, transformers and peft every time: several CPU seconds, and far more wall time on a loaded
2-core machine. :class:`ForkServer` pays them once. It starts one server process
(:mod:`.server`) that imports the given modules, starts no thread, and then forks one child per
:meth:`ForkServer.popen`. The child *becomes* the requested program (:mod:`.child`):

* its own ``argv``, environment (replaced whole), working directory and stdin/stdout/stderr (the
  caller's file descriptors, passed over a Unix socket with ``SCM_RIGHTS``);
* the program runs as ``__main__`` (``python -m MODULE``, ``python SCRIPT`` or ``python -c CODE``,
  with ``sys.path[0]`` and ``PYTHONPATH`` as ``python`` sets them);
* it ends as an interpreter ends up to its ``atexit`` hooks (threads joined, every hook run,
  output flushed), then ``os._exit`` with the exit status of ``sys.exit`` (1 for an uncaught
  exception), or by the signal that ended it (negative, as :mod:`subprocess` reports it): module
  teardown is skipped (it cost each child about 0.5 CPU-s: every preloaded page touched again).
  ``QUICK_EXIT_ENV=0`` in its environment keeps the whole interpreter finalization, for a test
  whose subject is the interpreter's end (:mod:`.child`);
* ``random`` and numpy's global generator re-seeded, default ``SIGCHLD`` handling,
  ``tempfile.tempdir`` forgotten (so ``TMPDIR`` of the new environment counts).

What it is not: a fresh interpreter. Modules the server imported keep what they read at import
(environment variables read at import time, such as ``HF_HUB_OFFLINE``, which the server sets as a
fresh machine of the tests and the demo does), and the hash seed is the server's. A test *about* a
fresh interpreter starts a real subprocess.

:class:`ForkedProcess` (:mod:`.process`) has the :class:`subprocess.Popen` surface the tests use,
and :func:`run` mirrors :func:`subprocess.run`. :func:`default_server` is the calling process's server
(the test session's, shared by its pytest-xdist workers through :data:`SHARED_SOCKET_ENV`, else one
of its own), preloaded with :data:`DEFAULT_PRELOAD` (:mod:`.preload`):
opd_store's job, the S3/GCS clients, the testing helpers, and the integrations' trainers when
installed. :meth:`ForkServer.shim_dir` gives shell scripts an ``opd-store`` command that runs through
the server. The wire protocol between them is in :mod:`.protocol`.

The modules: :mod:`.client` (:class:`ForkServer`, :func:`default_server`, :func:`popen`,
:func:`run`), :mod:`.process` (:class:`ForkedProcess`), :mod:`.protocol` (the socket protocol, both
ends, and the shim command), :mod:`.server` (the server process), :mod:`.child` (a forked child
becoming its program), :mod:`.preload` (what the server imports, under which environment).
"""

from .child import QUICK_EXIT_ENV
from .client import (
    SHARED_SOCKET_ENV,
    ForkServer,
    accepts_connections,
    default_server,
    popen,
    run,
)
from .preload import (
    DEFAULT_PRELOAD,
    OPTIONAL,
    REQUIRED_PRELOAD,
    SERVER_ENV,
    TRAINER_PRELOAD,
)
from .process import DEVNULL, PIPE, STDOUT, ForkedProcess

__all__ = [
    "DEFAULT_PRELOAD", "DEVNULL", "OPTIONAL", "PIPE", "QUICK_EXIT_ENV", "REQUIRED_PRELOAD", "SERVER_ENV", "SHARED_SOCKET_ENV",
    "STDOUT", "TRAINER_PRELOAD", "ForkServer", "ForkedProcess", "accepts_connections", "default_server", "popen",
    "run",
]
