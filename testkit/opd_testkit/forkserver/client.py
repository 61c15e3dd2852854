"""The client side of a fork server: start one, fork programs through it, stop it.

:class:`ForkServer` starts one server process (:mod:`.server`) preloaded with the given modules and
forks a child of it per :meth:`ForkServer.popen` (a :class:`~.process.ForkedProcess`);
:meth:`ForkServer.run` mirrors :func:`subprocess.run`. :func:`default_server` is the calling
process's server with :data:`~.preload.DEFAULT_PRELOAD`: the one named by :data:`SHARED_SOCKET_ENV`
(a test session's controller starts one for all its pytest-xdist workers), else one of its own;
:func:`popen` and :func:`run` use it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

from .preload import DEFAULT_PRELOAD, SERVER_ENV
from .process import DEVNULL, PIPE, STDOUT, ForkedProcess
from .protocol import program_of, shim_script

SHARED_SOCKET_ENV = "OPD_FORKSERVER_SOCKET"
"""The environment variable naming a running server's socket, which :func:`default_server` uses
instead of starting a server of its own (``tests/conftest.py`` sets it in the controller of a
pytest-xdist session, so that one server, not one per worker, pays the preload)."""


class ForkServer:
    """One preloaded server process; :meth:`popen` forks a child of it per program started.

    Args:
        preload (Sequence[str]): modules the server imports before it forks anything (a name
            ending in :data:`~.preload.OPTIONAL` only when it is installed).
        env (dict | None): the server's environment (default: this process's, plus
            :data:`~.preload.SERVER_ENV`). Modules read it at import; each child gets its own environment.
        wait_ready (bool): return once the preload is imported (default); ``False``: once the
            server's socket is bound, while it still imports (a child requested meanwhile is
            forked once the preload is done). A failed preload is then seen by the first request.
        socket_path (str | None): use the server already running there (started by another
            process, which stops it) instead of starting one; ``preload``, ``env`` and
            ``wait_ready`` are then ignored.

    Raises:
        RuntimeError: the server did not start (its stderr is in the message).
    """

    PIPE, DEVNULL, STDOUT = PIPE, DEVNULL, STDOUT

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, env: dict[str, str] | None = None, *,
                 wait_ready: bool = True, socket_path: str | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="opd-forkserver-")
        self._process: subprocess.Popen | None = None
        if socket_path is not None:
            self.socket_path = socket_path
            self.log_path = os.path.join(os.path.dirname(socket_path), "server.log")  # where a server keeps it
            self.preload: tuple[str, ...] = ()
            return
        self.socket_path = os.path.join(self._dir, "socket")
        self.log_path = os.path.join(self._dir, "server.log")  # a file: a full pipe would stall the server
        server_env = dict(os.environ, **SERVER_ENV) if env is None else dict(env)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "opd_testkit.forkserver.server", self.socket_path, *preload],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=server_env,
            )
        for expected in ("listening", "ready") if wait_ready else ("listening",):
            line = self._process.stdout.readline()
            if line.strip() != expected.encode():
                self._process.kill()
                self._process.wait()
                raise RuntimeError(f"the fork server did not start: {line!r}\n{self._log_tail()}")
        self.preload = tuple(preload)

    def popen(self, args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool | None = None,
              universal_newlines: bool | None = None, encoding: str | None = None,
              errors: str | None = None) -> ForkedProcess:
        """Start ``args`` (``[python, "-m", MODULE, ...]``, ``[python, SCRIPT, ...]`` or
        ``[python, "-c", CODE, ...]``) in a child; the other arguments are
        :class:`subprocess.Popen`'s (``stdin``/``stdout``/``stderr``: ``None`` to inherit,
        ``PIPE``, ``DEVNULL``, ``STDOUT`` for stderr, a file object or a descriptor).

        Raises:
            ValueError: ``args`` is not a Python command line of one of those forms.
        """
        program_of(list(map(os.fspath, args)))  # refuse what a child could not run, here
        try:
            return ForkedProcess(self.socket_path, [os.fspath(a) for a in args], env=env, cwd=cwd, stdin=stdin,
                                 stdout=stdout, stderr=stderr,
                                 text=bool(text or universal_newlines or encoding or errors),
                                 encoding=encoding, errors=errors)
        except (ConnectionError, FileNotFoundError, RuntimeError) as exc:  # no pid came back: no server
            raise RuntimeError(self._not_serving(exc)) from exc

    def _not_serving(self, exc: BaseException) -> str:
        """Why a request got no child, with the end of the server's log (its failed preload)."""
        return (f"the fork server at {self.socket_path} forked no child ({exc!r}); its log {self.log_path}:\n"
                f"{self._log_tail()}")

    def _log_tail(self) -> str:
        """The last 4,000 characters of the server's stderr log."""
        try:
            with open(self.log_path, "rb") as log:
                return log.read().decode(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

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
        """Whether the server runs (one this object did not start: whether its socket takes a
        connection, which the server then closes unanswered)."""
        if self._process is None:
            return accepts_connections(self.socket_path)
        return self._process.poll() is None

    def shim_dir(self) -> str:
        """A directory holding an ``opd-store`` command that runs ``python -m opd_store`` through
        this server (put it first on a child's ``PATH``).

        The command (:func:`~.protocol.shim_command`) passes its own stdin/stdout/stderr,
        environment and directory to the child, forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1
        and SIGUSR2 to it, and exits with its status (a child ended by a signal ends the command by the same signal). When the
        command itself is killed, the server kills the child.
        """
        directory = os.path.join(self._dir, "bin")
        if not os.path.isdir(directory):
            os.mkdir(directory)
            path = os.path.join(directory, "opd-store")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(shim_script(self.socket_path))
            os.chmod(path, 0o755)
        return directory

    def close(self) -> None:
        """Stop the server (one this object started); it kills the children still running."""
        if self._process is None:
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def accepts_connections(socket_path: str) -> bool:
    """Whether a server listens on the Unix socket ``socket_path`` (a connection made and closed;
    one made while the server still imports its preload waits in the backlog and counts)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


_DEFAULT: ForkServer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_server() -> ForkServer:
    """This process's server with :data:`~.preload.DEFAULT_PRELOAD`: the running one whose socket
    :data:`SHARED_SOCKET_ENV` names, else (none named, or none listening there: a stale name, a
    server that died) one of its own (started on first use, stopped at exit; started again if it
    died)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or not _DEFAULT.alive():
            shared = os.environ.get(SHARED_SOCKET_ENV)
            if shared and accepts_connections(shared):
                _DEFAULT = ForkServer(socket_path=shared)
            else:
                _DEFAULT = ForkServer()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def popen(args: Sequence[str], **kwargs: Any) -> ForkedProcess:
    """:meth:`ForkServer.popen` on :func:`default_server`."""
    return default_server().popen(args, **kwargs)


def run(args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """:meth:`ForkServer.run` on :func:`default_server`."""
    return default_server().run(args, **kwargs)
