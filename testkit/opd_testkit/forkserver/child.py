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

    def program() -> None:
        import runpy

        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})

    return program
