"""The tests' fork server (:mod:`opd_testkit.forkserver`) shared through its socket, as the
controller of a pytest-xdist run shares one with its workers (``tests/conftest.py``): a client
attached to another's server forks its children there, detaching leaves the server running, and a
server returned before its preload is imported forks only once the preload is done."""

from __future__ import annotations

import os
import sys

from opd_testkit.forkserver import ForkServer

PROBE = "import os, sys; print(os.getppid(), 'colorsys' in sys.modules)"


def test_a_server_shared_through_its_socket_forks_the_children_of_every_client():
    owner = ForkServer(preload=("colorsys",), env={"PATH": "/usr/bin:/bin"}, wait_ready=False)
    try:
        attached = ForkServer(socket_path=owner.socket_path)
        first = attached.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        # Requested as soon as the socket was bound: forked once the preload was done.
        server_pid, preloaded = first.stdout.split()
        assert (first.returncode, preloaded) == (0, "True")
        assert attached.alive() and attached.preload == ()
        attached.close()  # detaching does not stop the server
        second = owner.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        assert (second.returncode, second.stdout.split()) == (0, [server_pid, "True"])
        assert owner.alive()
    finally:
        owner.close()
    assert not owner.alive() and not os.path.exists(owner.socket_path)


def test_a_shared_server_that_failed_its_preload_or_is_gone_is_named_with_its_log():
    """A server returned before its preload whose preload then fails (a module that raises) forks
    nothing: the request says so with the end of the server's log (the import error), not a bare
    connection error. The socket it leaves, which nobody listens on (what a stale
    ``OPD_FORKSERVER_SOCKET`` names), takes no connection: :func:`~opd_testkit.forkserver.
    default_server` checks that before it attaches, and starts a server of its own instead."""
    import pytest
    from opd_testkit.forkserver import accepts_connections

    broken = ForkServer(preload=("colorsys", "opd_store_no_such_module"), env={"PATH": "/usr/bin:/bin"},
                        wait_ready=False)
    try:
        with pytest.raises(RuntimeError) as caught:
            broken.run([sys.executable, "-c", "pass"], timeout=120)
        message = str(caught.value)
        assert message.startswith(f"the fork server at {broken.socket_path} forked no child (")
        assert "No module named 'opd_store_no_such_module'" in message
        assert os.path.exists(broken.socket_path) and not accepts_connections(broken.socket_path)
    finally:
        broken.close()


def test_a_quick_exit_child_ends_as_an_interpreter_does_up_to_its_atexit_hooks():
    """The default (and ``QUICK_EXIT_ENV=1``): threads joined, the program's ``atexit`` hooks run,
    output flushed, the interpreter's exit status, no module teardown; ``QUICK_EXIT_ENV=0``: the
    teardown too. The variable itself is not in the program's environment."""
    from opd_testkit.forkserver import QUICK_EXIT_ENV, default_server

    # module teardown drops the module's globals: an object's finalizer prints only then
    teardown = "class Noisy:\n    def __del__(self): print('teardown')\nnoisy = Noisy()\n"
    for setting, out in ((None, ""), ("1", ""), ("0", "teardown\n")):
        env = {k: v for k, v in os.environ.items() if k != QUICK_EXIT_ENV}
        if setting is not None:
            env[QUICK_EXIT_ENV] = setting
        done = default_server().run([sys.executable, "-c", teardown], env=env, capture_output=True, text=True,
                                    timeout=60)
        assert (setting, done.returncode, done.stdout) == (setting, 0, out), done

    env = dict(os.environ, **{QUICK_EXIT_ENV: "1"})
    program = ("import atexit, os, sys, threading\n"
               "go = threading.Event()\n"
               "threading.Thread(target=lambda: (go.wait(), print('thread done'))).start()\n"
               f"atexit.register(print, 'hook', os.environ.get({QUICK_EXIT_ENV!r}))\n"
               "print('out', end=' ')\n"
               "go.set()\n"
               "sys.exit(3)\n")
    cases = [(program, 3, "out thread done\nhook None\n", ""), ("import sys; sys.exit('bye')", 1, "", "bye\n"),
             ("raise ValueError('x')", 1, "", "ValueError: x\n")]
    for code, status, out, err_end in cases:
        done = default_server().run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout, done.stderr.endswith(err_end)) == (status, out, True), done
