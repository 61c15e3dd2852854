"""Start Python programs as new processes forked from a parent that has already imported them.

A test that starts ``python -m opd_store train ...`` pays an interpreter start and the imports of
torch, transformers and peft every time: several CPU seconds, and far more wall time on a loaded
2-core machine. :class:`ForkServer` pays them once. It starts one server process
(``python -m opd_store.testing.forkserver``) that imports the given modules, starts no thread, and
then forks one child per :meth:`ForkServer.popen`. The child *becomes* the requested program:

* its own ``argv``, environment (replaced whole), working directory and stdin/stdout/stderr (the
  caller's file descriptors, passed over a Unix socket with ``SCM_RIGHTS``);
* the program runs as ``__main__`` (``python -m MODULE``, ``python SCRIPT`` or ``python -c CODE``,
  with ``sys.path[0]`` and ``PYTHONPATH`` as ``python`` sets them);
* it ends as an interpreter ends: ``atexit`` hooks, interpreter finalization, the exit status of
  ``sys.exit`` (1 for an uncaught exception), or the signal that ended it (negative, as
  :mod:`subprocess` reports it);
* ``random`` and numpy's global generator re-seeded, default ``SIGCHLD`` handling,
  ``tempfile.tempdir`` forgotten (so ``TMPDIR`` of the new environment counts).

What it is not: a fresh interpreter. Modules the server imported keep what they read at import
(environment variables read at import time, such as ``HF_HUB_OFFLINE``, which the server sets as a
fresh machine of the tests and the demo does), and the hash seed is the server's. A test *about* a
fresh interpreter starts a real subprocess.

:class:`ForkedProcess` has the :class:`subprocess.Popen` surface the tests use (``pid``,
``returncode``, ``stdin``/``stdout``/``stderr`` pipes, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``terminate``, ``kill``), and :func:`run` mirrors :func:`subprocess.run`.
:func:`default_server` is one server per calling process (a pytest-xdist worker), preloaded with
opd_store's job, the S3/GCS clients and the testing helpers.

Protocol (one Unix-socket connection per child): the client sends an 8-byte big-endian length with
the three descriptors, then that many bytes of JSON (``argv``, ``env``, ``cwd``); the server
answers ``{"pid": N}`` and, once the child has been reaped, ``{"status": S}`` (one JSON line each).
The server exits, killing its children, when its stdin closes (its parent is gone).
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Sequence

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

# What a test's child needs most: the job (torch, transformers, peft), the store with every client.
REQUIRED_PRELOAD = (
    "opd_store",
    "opd_store.cli",
    "opd_store.job.train",
    "opd_store.job.models",
    "opd_store.opd.async_save",
    "opd_store.opd.checkpoint",
    "opd_store.preemption",
    "opd_store.testing.stores",
    "s3fs",
    "gcsfs",
    "peft",
    "transformers",
)
# The trainers of the integrations' children (tests/integrations: a TRL GKD run, a transformers
# Trainer on two ranks, a Lightning Trainer), imported when their extras (hf, lightning) are
# installed: about 0.5 CPU-seconds more per server, against several per child without them.
TRAINER_PRELOAD = (
    "transformers.trainer",
    "accelerate",
    "datasets",
    "trl.experimental.gkd",
    "lightning.pytorch",
    "opd_store.integrations.transformers",
    "opd_store.integrations.lightning",
    "opd_store.job.trl_demo",
    "opd_store.testing.events",
)
OPTIONAL = "?"
"""A preload name ending in it is imported only when installed (``ModuleNotFoundError`` ignored)."""
DEFAULT_PRELOAD = REQUIRED_PRELOAD + tuple(name + OPTIONAL for name in TRAINER_PRELOAD)
# Read at import by huggingface_hub and transformers; set as opd_store's fresh machines set them.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TRL_EXPERIMENTAL_SILENCE": "1"}
_HEADER = struct.Struct(">Q")


# -- client --------------------------------------------------------------------------------------


class ForkServer:
    """One preloaded server process; :meth:`popen` forks a child of it per program started.

    Args:
        preload (Sequence[str]): modules the server imports before it forks anything (a name
            ending in :data:`OPTIONAL` only when it is installed).
        env (dict | None): the server's environment (default: this process's, plus
            :data:`SERVER_ENV`). Modules read it at import; each child gets its own environment.

    Raises:
        RuntimeError: the server did not start (its stderr is in the message).
    """

    PIPE, DEVNULL, STDOUT = PIPE, DEVNULL, STDOUT

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="opd-forkserver-")
        self.socket_path = os.path.join(self._dir, "socket")
        self.log_path = os.path.join(self._dir, "server.log")  # a file: a full pipe would stall the server
        server_env = dict(os.environ, **SERVER_ENV) if env is None else dict(env)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "opd_store.testing.forkserver", self.socket_path, *preload],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=server_env,
            )
        line = self._process.stdout.readline()
        if line.strip() != b"ready":
            self._process.kill()
            self._process.wait()
            with open(self.log_path, "rb") as log:
                detail = log.read().decode(errors="replace")[-4000:]
            raise RuntimeError(f"the fork server did not start: {line!r}\n{detail}")
        self.preload = tuple(preload)

    def popen(self, args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool | None = None,
              universal_newlines: bool | None = None, encoding: str | None = None,
              errors: str | None = None) -> "ForkedProcess":
        """Start ``args`` (``[python, "-m", MODULE, ...]``, ``[python, SCRIPT, ...]`` or
        ``[python, "-c", CODE, ...]``) in a child; the other arguments are
        :class:`subprocess.Popen`'s (``stdin``/``stdout``/``stderr``: ``None`` to inherit,
        ``PIPE``, ``DEVNULL``, ``STDOUT`` for stderr, a file object or a descriptor).

        Raises:
            ValueError: ``args`` is not a Python command line of one of those forms.
        """
        _program(list(map(os.fspath, args)))  # refuse what a child could not run, here
        return ForkedProcess(self, [os.fspath(a) for a in args], env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                             stderr=stderr, text=bool(text or universal_newlines or encoding or errors),
                             encoding=encoding, errors=errors)

    def run(self, args: Sequence[str], *, input: Any = None, capture_output: bool = False,
            timeout: float | None = None, check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
        """:func:`subprocess.run` through :meth:`popen` (same arguments and errors)."""
        if capture_output:
            kwargs["stdout"] = kwargs["stderr"] = PIPE
        if input is not None:
            kwargs["stdin"] = PIPE
        with self.popen(args, **kwargs) as process:
            try:
                out, err = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
        result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def alive(self) -> bool:
        return self._process.poll() is None

    def shim_dir(self) -> str:
        """A directory holding an ``opd-store`` command that runs ``python -m opd_store`` through
        this server (put it first on a child's ``PATH``).

        The command (:func:`client`) passes its own stdin/stdout/stderr, environment and directory
        to the child, forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to it, and exits
        with its status (a child ended by a signal ends the command by the same signal). When the
        command itself is killed, the server kills the child.
        """
        directory = os.path.join(self._dir, "bin")
        if not os.path.isdir(directory):
            os.mkdir(directory)
            path = os.path.join(directory, "opd-store")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"#!/bin/sh\nexec '{sys.executable}' '{os.path.abspath(__file__)}' --client "
                             f"'{self.socket_path}' -m opd_store \"$@\"\n")
            os.chmod(path, 0o755)
        return directory

    def close(self) -> None:
        """Stop the server; it kills the children still running."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class _Connection:
    """One request to a server: send it with the child's three descriptors, read its answers."""

    def __init__(self, socket_path: str, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        socket.send_fds(self.sock, [_HEADER.pack(len(request))], fds)
        self.sock.sendall(request)
        self._buffer = b""
        self.pid = self.message(None)["pid"]

    def message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next JSON line; ``None`` when none came within ``timeout`` (0: poll)."""
        while b"\n" not in self._buffer:
            self.sock.settimeout(timeout)
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, TimeoutError):
                return None
            finally:
                self.sock.settimeout(None)
            if not data:
                raise RuntimeError("the fork server went away while the child ran")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


class ForkedProcess:
    """A child of a :class:`ForkServer`, used like :class:`subprocess.Popen`."""

    def __init__(self, server: ForkServer, args: list[str], *, env, cwd, stdin, stdout, stderr, text: bool,
                 encoding: str | None, errors: str | None) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._readers: dict[str, threading.Thread] = {}
        self._collected: dict[str, list[bytes]] = {}
        ours: list[int] = []  # descriptors opened here for the child, closed once sent
        fds = []
        for which, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if spec is None:
                fds.append(("stdin", "stdout", "stderr").index(which))
            elif spec == PIPE:
                read_fd, write_fd = os.pipe()
                child_end, our_end, mode = (read_fd, write_fd, "wb") if which == "stdin" else (write_fd, read_fd, "rb")
                stream = open(our_end, mode, buffering=0 if which == "stdin" else -1)  # noqa: SIM115
                if text:
                    stream = io.TextIOWrapper(stream, encoding=encoding or "utf-8", errors=errors or "strict",
                                              write_through=which == "stdin")
                setattr(self, which, stream)
                fds.append(child_end)
                ours.append(child_end)
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                fds.append(fd)
                ours.append(fd)
            elif spec == STDOUT and which == "stderr":
                fds.append(fds[1])
            elif isinstance(spec, int):
                fds.append(spec)
            else:
                fds.append(spec.fileno())
        try:
            self._conn = _Connection(server.socket_path, args, dict(os.environ if env is None else env),
                                     os.fspath(cwd) if cwd is not None else os.getcwd(), fds)
        finally:
            for fd in ours:
                os.close(fd)
        self.pid = self._conn.pid

    # the Popen surface ------------------------------------------------------------------------
    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._conn.message(timeout)
            if message is not None:
                self.returncode = message["status"]
                self._conn.sock.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their end, wait; ``(out, err)`` (``None``
        for a stream that is not a pipe).

        Raises:
            subprocess.TimeoutExpired: not finished within ``timeout``; call again to go on.
        """
        if self.stdin is not None and not self.stdin.closed:
            if input:
                try:
                    self.stdin.write(input)
                except BrokenPipeError:
                    pass
            self.stdin.close()
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                chunks: list = []
                self._collected[name] = chunks
                self._readers[name] = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()),
                                                       daemon=True)
                self._readers[name].start()
        deadline = None if timeout is None else _monotonic() + timeout
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - _monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - _monotonic()))
        out = err = None
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                value = self._collected[name][0] if self._collected[name] else stream.read()
                stream.close()
                if name == "stdout":
                    out = value
                else:
                    err = value
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        self.wait()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode}, args={self.args!r})"


def _monotonic() -> float:
    import time

    return time.monotonic()


_DEFAULT: ForkServer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_server() -> ForkServer:
    """This process's server with :data:`DEFAULT_PRELOAD` (started on first use, stopped at exit;
    started again if it died)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or not _DEFAULT.alive():
            _DEFAULT = ForkServer()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def popen(args: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """:meth:`ForkServer.popen` on :func:`default_server`."""
    return default_server().popen(args, **kwargs)


def run(args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """:meth:`ForkServer.run` on :func:`default_server`."""
    return default_server().run(args, **kwargs)


# -- server --------------------------------------------------------------------------------------


def _program(argv: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, sys.argv)`` of a ``python`` command line: kind ``module``, ``path`` or ``code``.

    Raises:
        ValueError: not ``[python, "-m", MODULE, ...]``, ``[python, "-c", CODE, ...]`` or
            ``[python, SCRIPT, ...]``.
    """
    if len(argv) < 2 or "python" not in os.path.basename(argv[0]):
        raise ValueError(f"not a python command line: {argv!r}")
    if argv[1] == "-m" and len(argv) >= 3:
        return "module", argv[2], [argv[2], *argv[3:]]
    if argv[1] == "-c" and len(argv) >= 3:
        return "code", argv[2], ["-c", *argv[3:]]
    if argv[1].startswith("-"):
        raise ValueError(f"python option {argv[1]!r} is not supported by the fork server: {argv!r}")
    return "path", argv[1], argv[1:]


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
    while len(head) < _HEADER.size:  # a stream socket may deliver the header in pieces
        more = conn.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError("client went away")
        head += more
    (length,) = _HEADER.unpack(head)
    body = b""
    while len(body) < length:
        more = conn.recv(length - len(body))
        if not more:
            raise EOFError("client went away")
        body += more
    return json.loads(body), list(fds)


def _std_stream(fd: int, name: str, env: dict[str, str]) -> io.TextIOWrapper:
    """``sys.stdin``/``stdout``/``stderr`` as a new interpreter builds them over ``fd``."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    raw = open(fd, "rb" if name == "stdin" else "wb", buffering=0, closefd=False)  # noqa: SIM115
    interactive = os.isatty(fd)
    if name == "stdin":
        buffered = io.BufferedReader(raw)
    else:
        buffered = raw if unbuffered and name != "stdin" else io.BufferedWriter(raw)
    stream = io.TextIOWrapper(
        buffered, encoding=env.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8",
        errors="backslashreplace" if name == "stderr" else "strict",
        line_buffering=name == "stderr" or (interactive and name == "stdout"),
        write_through=unbuffered,
    )
    return stream


def _become(request: dict[str, Any], fds: list[int]) -> Callable[[], None]:
    """In the forked child: take the request's stdio, environment, directory and argv; return the
    program to run as ``__main__``."""
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
    tempfile.tempdir = None
    kind, target, argv = _program(request["argv"])
    sys.argv = argv
    first = os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd()
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra] + [p for p in sys.path[1:] if p not in extra and p != first]
    sys.stdin, sys.stdout, sys.stderr = (_std_stream(i, n, env) for i, n in enumerate(("stdin", "stdout", "stderr")))
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


def serve(socket_path: str, preload: Sequence[str]) -> Callable[[], None]:
    """The server loop. Returns only in a forked child, with the program that child must run."""
    import importlib

    for name in preload:
        try:
            importlib.import_module(name.removesuffix(OPTIONAL))
        except ModuleNotFoundError:
            if not name.endswith(OPTIONAL):
                raise
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"preloading {list(preload)} started threads {names}; forking now is unsafe")
    # Everything imported so far goes to the collector's permanent generation: a child's collections
    # (the last ones at its exit among them) then never write to these objects' headers, which
    # would copy most of the server's memory into every child (1.6 s of CPU per child with torch
    # and transformers loaded, 0.3 s with this; the gc module docs recommend it before fork()).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):  # the client process is gone
                    for pid in children:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    raise SystemExit(0)
            elif isinstance(key.data, int):  # a client connection: readable means it went away
                selector.unregister(key.fileobj)
                try:
                    gone = not key.fileobj.recv(1)
                except OSError:
                    gone = True
                if gone and key.data in children:
                    try:
                        os.kill(key.data, signal.SIGKILL)  # its client was killed: so is the child
                    except ProcessLookupError:
                        pass
            elif key.data == "reap":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            selector.unregister(conn)
                        except (KeyError, ValueError):
                            pass
                        try:
                            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    os.close(sys.stdin.fileno())
                    return _become(request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                selector.register(conn, selectors.EVENT_READ, pid)


_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def client(socket_path: str, argv: list[str]) -> int:
    """The ``opd-store`` command of :meth:`ForkServer.shim_dir`: run ``argv`` in a child of the
    server at ``socket_path`` with this process's stdio, environment and directory; forward signals;
    return its exit status (ending this process by the child's signal when a signal ended it)."""
    conn = _Connection(socket_path, argv, dict(os.environ), os.getcwd(), [0, 1, 2])
    for name in _FORWARDED:
        signal.signal(getattr(signal, name), lambda signum, _frame: os.kill(conn.pid, signum))
    status = conn.message(None)["status"]
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return 128 - status if status < 0 else status


def main(argv: list[str]) -> None:
    if argv[:1] == ["--client"]:
        raise SystemExit(client(argv[1], [sys.executable, *argv[2:]]))
    program = serve(argv[0], argv[1:])
    del argv
    program()


if __name__ == "__main__":
    main(sys.argv[1:])
