"""In a child just forked from the fork server: become the requested program.

The child takes the request's stdio, environment (replaced whole), working directory and ``argv``,
sets ``sys.path[0]`` and ``PYTHONPATH`` as ``python`` does, and builds ``sys.stdin``/``stdout``/
``stderr`` as a new interpreter builds them. What it cannot undo: modules the server imported keep
what they read at import, and the hash seed is the server's.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import tempfile
from typing import Any, Callable

from .protocol import program_of

QUICK_EXIT_ENV = "OPD_FORKSERVER_QUICK_EXIT"
"""``0`` in a request's environment: the child ends as an interpreter ends, module teardown
included (a test about the interpreter's end); absent or any other value: it skips module teardown
(module docstring), about 0.5 CPU-s less per child."""


def exit_status(code: object) -> int:
    """The exit status of ``SystemExit(code)`` as the interpreter computes it (``None``: 0; an
    int: itself; anything else, which the interpreter prints on stderr: 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


_quick_exit: dict[str, int | None] | None = None  # set in a quick-exit child: {"code": its exit status}


def end_if_quick_exit() -> None:
    """An ``atexit`` hook the server registers before its preload, so it runs after every other
    hook (the program's and the preloaded modules', ``logging.shutdown`` among them): in a
    quick-exit child, flush stdout and stderr and ``os._exit`` with the interpreter's exit status;
    elsewhere (the server, other children, a ``KeyboardInterrupt``, which ends the interpreter by
    SIGINT) nothing."""
    if _quick_exit is None or _quick_exit["code"] is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(_quick_exit["code"])


def std_stream(fd: int, name: str, env: dict[str, str]) -> io.TextIOWrapper:
    """``sys.stdin``/``stdout``/``stderr`` (``name``) as a new interpreter builds them over ``fd``,
    honouring ``PYTHONUNBUFFERED`` and ``PYTHONIOENCODING`` of ``env``."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    raw = open(fd, "rb" if name == "stdin" else "wb", buffering=0, closefd=False)  # noqa: SIM115
    interactive = os.isatty(fd)
    if name == "stdin":
        buffered = io.BufferedReader(raw)
    else:
        buffered = raw if unbuffered else io.BufferedWriter(raw)
    stream = io.TextIOWrapper(
        buffered, encoding=env.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8",
        errors="backslashreplace" if name == "stderr" else "strict",
        line_buffering=name == "stderr" or (interactive and name == "stdout"),
        write_through=unbuffered,
    )
    return stream


def become(request: dict[str, Any], fds: list[int]) -> Callable[[], None]:
    """Take the request's stdio (``fds``: its stdin, stdout, stderr), environment, directory and
    argv; return the program to run as ``__main__`` (``runpy`` for a module or a script, ``exec``
    for ``-c`` code).

    Raises:
        ValueError: the request's argv is not a Python command line (:func:`program_of`).
        OSError: its working directory cannot be entered.
    """
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    quick_exit = os.environ.pop(QUICK_EXIT_ENV, "1") != "0"
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # so that TMPDIR of the new environment counts
    kind, target, argv = program_of(request["argv"])
    sys.argv = argv
    first = os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd()
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra] + [p for p in sys.path[1:] if p not in extra and p != first]
    sys.stdin, sys.stdout, sys.stderr = (std_stream(i, n, env) for i, n in enumerate(("stdin", "stdout", "stderr")))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a new interpreter seeds numpy's global generator afresh

    global _quick_exit
    status: dict[str, int | None] = {"code": 1}  # an uncaught exception: 1
    if quick_exit:
        _quick_exit = status

    def program() -> None:
        import runpy

        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "path":
                runpy.run_path(target, run_name="__main__")
            else:
                exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status["code"] = 0
        except SystemExit as exc:
            status["code"] = exit_status(exc.code)
            raise
        except KeyboardInterrupt:
            status["code"] = None
            raise

    return program
