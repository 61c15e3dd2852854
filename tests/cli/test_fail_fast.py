"""Every unusable store is refused in seconds, in one line, before any work.

Each case runs ``python -m opd_store`` as a real process against a real backend on loopback
(fake-gcs-server with no bucket, a GCS or S3 endpoint at a closed port, a TCP listener that
accepts and never answers, moto with a missing bucket, unwritable and missing local paths, URL
schemes opd_store cannot commit to) for ``ls``, ``latest``, ``show``, ``verify``, ``train``,
``demo --store``, ``cp`` and ``gc``, all commands of a case at once. The processes are forked from
a fork server of this module preloaded with what the CLI imports (opd_store, s3fs, gcsfs; not the
job's torch and transformers, whose pages every child's full interpreter end would touch again:
:mod:`opd_testkit.forkserver`), except where the case is about what a new interpreter reads when
it starts: two commands of GCS without credentials (nothing printed while the modules load reaches
stderr) and the read-only bind mount (the command must start inside the mount namespace). Each must exit with the
documented code, print exactly one line on stderr naming the URL, the operation and the cause
(no client library's retry log, no traceback), print nothing on stdout, and return within the
check's bound plus a generous margin (an upper limit, not a speed target: machines here are
shared and noisy).

Nothing outside loopback is contacted and no external name is resolved: GCS runs with
``STORAGE_EMULATOR_HOST`` at a loopback port and google-auth's metadata server at a closed
loopback port; S3 runs with an explicit endpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit.forkserver import SERVER_ENV, ForkServer

import opd_store
from opd_store import CheckpointStore

REPO_ROOT = Path(opd_store.__file__).resolve().parents[1]
DEFAULT_BOUND_SECS = 15.0
FAST_BOUND_SECS = 2.0
MARGIN_SECS = 30.0  # process start, imports, eight processes at once on a loaded 2-core machine

SUPPORTED = ("local paths (or file://), memory://, s3:// (s3a://) and gs:// (gcs://) commit create-only; "
             "any other fsspec protocol only with allow_check_then_put=True (CLI: --allow-check-then-put), "
             "which lets two writers of one step both commit (docs/protocol.md)")
GCS_SOURCES = "GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server"

# The command lines of every case: {url} is the unusable store, {good} a local store holding a
# complete step 1, {tmp} a fresh directory. ``cp`` copies into the unusable store; ``cp-from``
# copies out of it.
COMMANDS = {
    "ls": ["ls", "{url}"],
    "latest": ["latest", "{url}"],
    "show": ["show", "{url}", "1"],
    "verify": ["verify", "{url}"],
    "gc": ["gc", "{url}", "--yes"],
    "cp": ["cp", "{good}", "1", "{url}"],
    "cp-from": ["cp", "{url}", "1", "{tmp}/copy"],
    "train": ["train", "--store", "{url}", "--updates", "2", "--log", "{tmp}/train.jsonl"],
    "demo": ["demo", "--store", "{url}", "--updates", "4", "--workdir", "{tmp}/demo"],
}
READS = ("ls", "latest", "show", "verify", "cp-from")
WRITES = ("gc", "cp", "train", "demo")
# Each case runs every command that writes and two or three that read (each read command in
# several cases): the same check runs for all of them, and a process costs about a second of CPU.


@dataclasses.dataclass
class Result:
    command: str
    code: int
    out: str
    err: str
    secs: float


def closed_port() -> int:
    """A loopback port the OS just handed out and nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SilentListener:
    """A TCP listener on loopback that accepts every connection and never sends a byte (a wrong
    proxy, a stuck gateway)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_listener():
    listener = SilentListener()
    yield listener
    listener.close()


@pytest.fixture
def good_store(tmp_path) -> str:
    url = str(tmp_path / "good")
    with CheckpointStore(url).begin(1, metadata={"successful_updates": 1}) as txn:
        txn.write_bytes("model.bin", b"step one")
    return url


def without_cloud_settings(env: dict[str, str]) -> dict[str, str]:
    """``env`` less every credential and cloud setting, google-auth's metadata server on a closed
    loopback port."""
    metadata = f"127.0.0.1:{closed_port()}"
    env = {name: value for name, value in env.items()
           if not name.startswith(("AWS_", "GOOGLE_", "GCE_", "STORAGE_EMULATOR", "CLOUDSDK_"))}
    return dict(env, GCE_METADATA_HOST=metadata, GCE_METADATA_IP=metadata)


@pytest.fixture(scope="module")
def cli_server():
    """The fork server of this module's commands: the CLI and the clients it imports, under an
    environment with no cloud settings (google-auth reads the metadata server's address at import,
    gcsfs its experimental switch, off as in :func:`base_env`)."""
    env = without_cloud_settings(dict(os.environ, **SERVER_ENV, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"))
    server = ForkServer(preload=("opd_store", "opd_store.cli", "s3fs", "gcsfs"), env=env)
    yield server
    server.close()


def base_env(tmp_path: Path) -> dict[str, str]:
    """The environment of every case: no credentials, no cloud configuration, and every metadata
    or token endpoint on a closed loopback port."""
    env = without_cloud_settings(dict(os.environ))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        PYTHONPATH=str(REPO_ROOT), HOME=str(home), CLOUDSDK_CONFIG=str(home / "gcloud"),
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(home / "aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "aws-credentials"),
    )
    return env


def run_all(commands: dict[str, list[str]], env: dict[str, str], cwd: Path, server: ForkServer | None, *,
            timeout_secs: float = 300, prefix: list[str] | None = None) -> dict[str, Result]:
    """Start every command at once (forked from ``server``; ``None``: each a new interpreter,
    started by the command ``prefix`` when given); wait for all; measure each from its start to
    its own exit.

    The fork server is started before any clock runs (its start imports the CLI and the clients:
    seconds on a loaded machine, no part of a command's time), and each command is waited for on a
    thread of its own, so a command's time ends at its exit, not when the commands started before
    it have been collected."""
    start = subprocess.Popen if server is None else server.popen
    env = dict(env, **{forkserver.QUICK_EXIT_ENV: "0"})  # one line on stderr: the interpreter's whole end
    started = {}
    for name, argv in commands.items():
        started[name] = (time.monotonic(), start(
            [*(prefix or []), sys.executable, "-m", "opd_store", *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))

    def collect(name: str) -> Result:
        began, proc = started[name]
        out, err = proc.communicate(timeout=timeout_secs)
        return Result(name, proc.returncode, out, err, time.monotonic() - began)

    with ThreadPoolExecutor(max_workers=len(started)) as pool:
        return dict(zip(started, pool.map(collect, started)))


def commands_for(url: str, good: str, tmp: Path, names, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The command lines ``names`` with the store options ``extra`` (for ``cp``, whose unusable
    store is its destination, as the destination's options)."""
    out = {}
    for name in names:
        argv = [part.format(url=url, good=good, tmp=tmp) for part in COMMANDS[name]]
        options = list(extra)
        if name == "cp":
            options = [{"--storage-option": "--dst-storage-option", "--s3-endpoint-url": "--dst-s3-endpoint-url"}
                       .get(arg, arg) for arg in options]
        out[name] = argv + options
    return out


def assert_refused(result: Result, *, code: int, line: str, bound_secs: float) -> None:
    """Exit ``code``, exactly ``line`` on stderr (one line), nothing on stdout, within the bound."""
    command = result.command.split("-")[0]
    assert (result.code, result.err.splitlines(), result.out) == (
        code, [f"opd-store {command}: error: {line}"], ""), result
    assert result.secs < bound_secs + MARGIN_SECS, result


# -- GCS -------------------------------------------------------------------------------------------
def test_gcs_without_credentials_is_refused_in_one_line(tmp_path, good_store, cli_server):
    """No credentials anywhere (gcsfs would fall back to anonymous access and retry for minutes):
    every command says so in one line, before any request to the store. The metadata server
    google-auth asks is the one in the environment when it is imported: a closed loopback port in
    the module's fork server's, and in the new interpreters that run ``ls`` and ``train`` (a read
    and a write; they also show that nothing printed while the modules load reaches stderr)."""
    env = base_env(tmp_path)
    env["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{closed_port()}"  # never contacted
    url = "gs://bucket/x"
    commands = commands_for(url, good_store, tmp_path, ("ls", "show", *WRITES))
    fresh = {name: commands.pop(name) for name in ("ls", "train")}
    results = {**run_all(fresh, env, tmp_path, None), **run_all(commands, env, tmp_path, cli_server)}
    assert sorted(results) == sorted(("ls", "show", *WRITES))
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: no credentials found ({GCS_SOURCES}); for a public bucket or an emulator "
                       "pass token=anon (--storage-option token=anon)")


def test_gcs_endpoint_at_a_closed_port(tmp_path, good_store, cli_server):
    port = closed_port()
    env = base_env(tmp_path)
    env["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    url = "gs://bucket/x"
    results = run_all(commands_for(url, good_store, tmp_path, ("latest", "verify", *WRITES),
                                   ("--storage-option", "token=anon")), env, tmp_path, cli_server)
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: cannot list the store: endpoint http://127.0.0.1:{port} refused the connection")


def test_gcs_missing_bucket_on_fake_gcs_server(tmp_path, good_store, fake_gcs, cli_server):
    env = base_env(tmp_path)
    url = "gs://no-such-bucket/x"
    options = ("--storage-option", f"endpoint_url={fake_gcs.endpoint_url}", "--storage-option", "token=anon",
               "--storage-option", "project=opd-test")
    results = run_all(commands_for(url, good_store, tmp_path, ("ls", "cp-from", *WRITES), options), env, tmp_path,
                      cli_server)
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS, line=f"{url}: bucket 'no-such-bucket' does not exist")


# -- S3 --------------------------------------------------------------------------------------------
def s3_env(tmp_path: Path) -> dict[str, str]:
    return dict(base_env(tmp_path), AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1")


def test_s3_endpoint_that_accepts_and_never_answers(tmp_path, good_store, silent_listener, cli_server, monkeypatch,
                                                    capsys):
    """An endpoint that accepts connections and never answers (a wrong proxy, a stuck gateway):
    every command gives up after a bound of 2 s, set with --connect-timeout-secs or the storage
    option connect_timeout_secs, instead of hanging. ``latest`` with no option gets the default
    bound (15 s), run in this process, where the check's wait is cut to 2 s once the bound it was
    given (15 s) is recorded: the default is proven without being waited out."""
    from opd_store.cli import main
    from opd_store.storage import _reachability

    endpoint = f"http://127.0.0.1:{silent_listener.port}"
    url = "s3://bkt/x"
    names = ["show", "cp-from", *WRITES, "latest"]
    commands = commands_for(url, good_store, tmp_path, names, ("--s3-endpoint-url", endpoint))
    for index, name in enumerate(names):
        commands[name] += (["--connect-timeout-secs", "2"] if index % 2 else
                           ["--storage-option", "connect_timeout_secs=2"])
    results = run_all(commands, s3_env(tmp_path), tmp_path, cli_server)
    for result in results.values():
        assert_refused(result, code=2, bound_secs=FAST_BOUND_SECS,
                       line=f"{url}: cannot list the store: endpoint {endpoint} did not answer within 2 s")
    assert silent_listener.accepted  # the requests did reach the listener

    bounds: list[float] = []
    wait_for = _reachability.call_within
    monkeypatch.setattr(_reachability, "call_within",
                        lambda timeout_secs, fn, **kwargs: bounds.append(timeout_secs) or wait_for(2.0, fn, **kwargs))
    for name, value in s3_env(tmp_path).items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    began = time.monotonic()
    default = Result("latest", main(["latest", url, "--s3-endpoint-url", endpoint]), *capsys.readouterr(), 0.0)
    default.secs = time.monotonic() - began
    assert bounds == [DEFAULT_BOUND_SECS]
    assert_refused(default, code=2, bound_secs=FAST_BOUND_SECS,
                   line=f"{url}: cannot list the store: endpoint {endpoint} did not answer within 15 s")


def test_s3_endpoint_at_a_closed_port(tmp_path, good_store, cli_server):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    url = "s3://bkt/x"
    results = run_all(commands_for(url, good_store, tmp_path, ("ls", "verify", *WRITES), ("--s3-endpoint-url", endpoint)),
                      s3_env(tmp_path), tmp_path, cli_server)
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: cannot list the store: endpoint {endpoint} refused the connection")


def test_s3_missing_bucket_on_moto(tmp_path, good_store, moto_s3, cli_server):
    url = "s3://no-such-bucket/x"
    results = run_all(commands_for(url, good_store, tmp_path, ("latest", "show", *WRITES),
                                   ("--s3-endpoint-url", moto_s3.endpoint_url)), s3_env(tmp_path), tmp_path,
                      cli_server)
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS, line=f"{url}: bucket 'no-such-bucket' does not exist")


# -- local paths -----------------------------------------------------------------------------------
def test_a_root_that_cannot_be_created(tmp_path, good_store, cli_server):
    """``/proc/forbidden``: a root process passes ``os.access`` on /proc and still cannot create
    anything there. Commands that write are refused before any work (``train`` used to train
    and lose the work at its first save); commands that read find no such directory (exit 3)."""
    url = "/proc/forbidden"
    assert os.access("/proc", os.W_OK) or os.getuid() != 0  # what the old check asked
    results = run_all(commands_for(url, good_store, tmp_path, ("ls", "cp-from", *WRITES)), base_env(tmp_path), tmp_path,
                      cli_server)
    for name in ("cp", "train", "demo"):
        assert_refused(results[name], code=2, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: cannot create the store root (No such file or directory)")
    for name in ("ls", "cp-from", "gc"):  # gc changes an existing store: a missing one is "not found"
        assert_refused(results[name], code=3, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: no such directory (a save creates it; check the path)")
    assert not Path(tmp_path / "train.jsonl").exists()  # no update ran


def readonly_bind_mount_prefix(path: Path) -> list[str] | None:
    """A command prefix that runs a command with ``path`` mounted read-only (a user and mount
    namespace, no privilege needed where the kernel allows them), or ``None`` where it cannot."""
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
              f'mount --bind -o ro "{path}" "{path}" && exec "$@"', "sh"]
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if done.returncode == 0 else None


def test_a_read_only_store_serves_reads_and_refuses_writes(tmp_path, good_store, cli_server):
    """A store on a read-only mount (a bind mount where the kernel allows one; else /proc/self,
    which exists and where nothing can be created, whatever ``os.access`` says): reads work,
    every command that writes is refused in one line before any work."""
    prefix = readonly_bind_mount_prefix(Path(good_store))
    env = base_env(tmp_path)
    url = good_store if prefix is not None else "/proc/self/fdinfo"
    cause = "Read-only file system" if prefix is not None else "No such file or directory"
    commands = commands_for(url, good_store, tmp_path, ("ls", *WRITES))
    commands["cp"] = ["cp", good_store, "1", url]
    # In the mount namespace: new interpreters.
    results = run_all(commands, env, tmp_path, cli_server if prefix is None else None, prefix=prefix)
    listing = results.pop("ls")
    if prefix is not None:
        assert listing.code == 0 and listing.out.splitlines()[1].split()[:2] == ["1", "complete"], listing
    for result in results.values():
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: cannot write in the store root ({cause})")
    assert CheckpointStore(good_store).steps() == [1]


def test_a_missing_directory_is_not_an_empty_store(tmp_path, good_store, cli_server):
    """A typo in a local path: read commands say "no such directory" (exit 3) instead of
    reporting an empty store; the first save creates it."""
    url = str(tmp_path / "no" / "such" / "dir")
    results = run_all(commands_for(url, good_store, tmp_path, (*READS, "gc")), base_env(tmp_path), tmp_path, cli_server)
    for result in results.values():
        assert_refused(result, code=3, bound_secs=DEFAULT_BOUND_SECS,
                       line=f"{url}: no such directory (a save creates it; check the path)")
    assert not Path(url).exists()
    done = run_all({"cp": ["cp", good_store, "1", url]}, base_env(tmp_path), tmp_path, cli_server)["cp"]
    assert (done.code, done.out, done.err) == (0, f"{url}/step-000001\n", "")
    assert CheckpointStore(url).read(1, "model.bin") == b"step one"


# -- URL schemes -----------------------------------------------------------------------------------
def test_unsupported_and_unknown_url_schemes(tmp_path, good_store, cli_server):
    """Refused naming the URL and what is supported, before any connection or name lookup (the
    host is a closed loopback port, so a regression could not reach anything either)."""
    ftp = f"ftp://127.0.0.1:{closed_port()}/x"
    unknown = f"nosuchscheme://127.0.0.1:{closed_port()}/x"
    commands = {**commands_for(ftp, good_store, tmp_path, ("ls", "train", "cp")),
                **{f"{name}-unknown": argv for name, argv in
                   commands_for(unknown, good_store, tmp_path, ("latest", "demo", "gc")).items()}}
    results = run_all(commands, base_env(tmp_path), tmp_path, cli_server)
    for name, result in results.items():
        line = (f"{unknown}: unknown URL scheme 'nosuchscheme'; {SUPPORTED}" if name.endswith("-unknown")
                else f"{ftp}: URL scheme 'ftp' has no create-only write; {SUPPORTED}")
        assert_refused(result, code=2, bound_secs=DEFAULT_BOUND_SECS, line=line)


# -- what stays out of stderr, and what -v shows -----------------------------------------------------
def test_verbose_shows_the_client_logs_and_the_traceback(tmp_path, cli_server):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    results = run_all({"ls": ["-v", "ls", "s3://bkt/x", "--s3-endpoint-url", endpoint]}, s3_env(tmp_path), tmp_path,
                      cli_server)
    err = results["ls"].err
    assert results["ls"].code == 2
    assert err.splitlines()[-1] == (f"opd-store ls: error: s3://bkt/x: cannot list the store: endpoint {endpoint} "
                                    "refused the connection")
    assert "Traceback (most recent call last)" in err and "EndpointConnectionError" in err
    assert "botocore" in err  # the client library's own log records
