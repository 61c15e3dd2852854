"""Preemption notices as a flag the training loop checks (docs/spot.md, "Preemption watcher").

GCE sends SIGTERM and sets the ``preempted`` metadata value, stopping the VM 30 s later (GCE
docs, "Detect if a VM was preempted"); AWS posts a spot ``instance-action`` two minutes ahead
(IMDSv2 token, then the notice: 404 none, 200 ``{"action", "time"}``, 401 renews the token; AWS EC2
User Guide, "Spot Instance interruption notices"); Kubernetes sends SIGTERM. A signal handler
takes no lock: it records the notice in a plain attribute and writes one byte to a pipe, and a
daemon thread reading the pipe wakes :meth:`PreemptionWatcher.wait` (a handler that set a
``threading.Event`` itself deadlocked when the signal interrupted the main thread inside that
Event's own ``wait``, which holds the Event's lock). Pollers run on daemon threads
with :mod:`urllib.request`, endpoints configurable (a fake metadata server on loopback in tests),
failed polls logged at debug and retried.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("opd_store.runtime")

AWS_METADATA_ENDPOINT = "http://169.254.169.254"
GCE_METADATA_ENDPOINT = "http://metadata.google.internal"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCE_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AWS_TOKEN_TTL_SECS = 21600
GCE_NOTICE_SECS = 30.0  # GCE stops a preempted VM 30 s after the notice
SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1")
# Metadata servers are link-local: never reached through an HTTP(S)_PROXY from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclasses.dataclass(frozen=True)
class PreemptionNotice:
    """The first notice the watcher received.

    Attributes:
        source (str): ``"SIGTERM"``/``"SIGINT"``/``"SIGUSR1"``, ``"aws-spot"`` or ``"gce"``.
        detail (str): the signal name, AWS's ``action`` and ``time``, or GCE's value.
        received_monotonic (float): ``time.monotonic()`` when it was seen.
        deadline_monotonic (float | None): when the platform takes the machine (monotonic clock):
            AWS's ``time``, 30 s after a GCE notice, ``None`` for a signal.
    """

    source: str
    detail: str
    received_monotonic: float
    deadline_monotonic: float | None

    def secs_left(self) -> float | None:
        """Seconds until the deadline (negative when past), or ``None`` when unknown."""
        return None if self.deadline_monotonic is None else self.deadline_monotonic - time.monotonic()


class PreemptionWatcher:
    """Turns preemption signals and spot notices into :meth:`should_checkpoint_now`.

    Args:
        signals (Iterable[str]): signal names to catch, from ``SIGTERM``, ``SIGINT``, ``SIGUSR1``
            (default: ``SIGTERM`` only; empty: none).
        aws_endpoint (str | None): poll the AWS spot ``instance-action`` notice at this metadata
            endpoint (``AWS_METADATA_ENDPOINT`` on EC2); ``None``: do not poll.
        gce_endpoint (str | None): poll the GCE ``preempted`` value at this metadata endpoint
            (``GCE_METADATA_ENDPOINT`` on GCE); ``None``: do not poll.
        poll_interval_secs (float): seconds between polls (AWS recommends every 5 s).
        request_timeout_secs (float): timeout of one metadata request, in seconds.
        gce_wait_for_change (bool): use GCE's hanging GET (``wait_for_change=true``) instead of
            polling; each request waits up to ``poll_interval_secs`` server-side.

    Raises:
        ValueError: an unknown signal name, or a non-positive interval or timeout.
    """

    def __init__(
        self,
        *,
        signals: Iterable[str] = ("SIGTERM",),
        aws_endpoint: str | None = None,
        gce_endpoint: str | None = None,
        poll_interval_secs: float = 5.0,
        request_timeout_secs: float = 2.0,
        gce_wait_for_change: bool = False,
    ) -> None:
        names = tuple(signals)
        unknown = [name for name in names if name not in SIGNAL_NAMES]
        if unknown:
            raise ValueError(f"unknown signal name(s) {unknown}; choose from {list(SIGNAL_NAMES)}")
        if poll_interval_secs <= 0 or request_timeout_secs <= 0:
            raise ValueError(
                f"poll_interval_secs ({poll_interval_secs}) and request_timeout_secs ({request_timeout_secs}) "
                "must be > 0"
            )
        self.signals = names
        self.aws_endpoint = aws_endpoint.rstrip("/") if aws_endpoint else None
        self.gce_endpoint = gce_endpoint.rstrip("/") if gce_endpoint else None
        self.poll_interval_secs = float(poll_interval_secs)
        self.request_timeout_secs = float(request_timeout_secs)
        self.gce_wait_for_change = gce_wait_for_change
        self._notice: PreemptionNotice | None = None
        self._noticed = threading.Event()  # set once self._notice is; wakes wait()
        self._notify_lock = threading.Lock()
        self._stop = threading.Event()
        self._previous_handlers: dict[int, Any] = {}
        self._signal_pipe: tuple[int, int] | None = None  # (read fd, write fd) while handlers are installed
        self._threads: list[threading.Thread] = []
        self._aws_token: str | None = None
        self.polls = {"aws-spot": 0, "gce": 0}

    # -- the flag ---------------------------------------------------------------------------------

    def should_checkpoint_now(self) -> bool:
        """Whether a notice arrived: save now, wait for the commit, and exit."""
        return self._notice is not None

    @property
    def notice(self) -> PreemptionNotice | None:
        """The first notice received, or ``None``."""
        return self._notice

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Block until a notice arrives or ``timeout_secs`` pass; return whether one arrived."""
        return self._noticed.wait(timeout_secs) or self._notice is not None

    def notify(self, source: str, detail: str, deadline_monotonic: float | None = None) -> None:
        """Record a notice (the first one wins; later ones are ignored). Safe from any thread, not
        from a signal handler (see the module docstring)."""
        with self._notify_lock:
            if self._notice is None:
                self._notice = PreemptionNotice(source, detail, time.monotonic(), deadline_monotonic)
        self._noticed.set()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> PreemptionWatcher:
        """Install the signal handlers and start the pollers.

        Raises:
            ValueError: signals were asked for and this is not the main thread (Python runs
                signal handlers only there).
        """
        if self.signals:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError(f"signals {list(self.signals)} can only be caught from the main thread")
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._signal_pipe = (read_fd, write_fd)
            self._start_thread("opd-preemption-signals", self._wake_on_signals)
        for name in self.signals:
            signum = getattr(signal, name)
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        if self.aws_endpoint:
            self._start_thread("opd-preemption-aws", self._run_poller, self._poll_aws)
        if self.gce_endpoint:
            self._start_thread("opd-preemption-gce", self._run_poller, self._poll_gce)
        return self

    def stop(self) -> None:
        """Put the previous signal handlers back and stop the pollers (waits for them briefly)."""
        self._stop.set()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        if self._signal_pipe is not None:
            os.close(self._signal_pipe[1])  # the reader sees end of file and returns
        for thread in self._threads:
            thread.join(self.request_timeout_secs + self.poll_interval_secs + 1.0)
        self._threads.clear()
        if self._signal_pipe is not None:
            os.close(self._signal_pipe[0])
            self._signal_pipe = None

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Runs on the main thread between two bytecodes, possibly inside a lock that thread holds:
        # an attribute assignment and one non-blocking write, no lock (a full pipe already holds a
        # wake-up).
        if self._notice is None:
            name = signal.Signals(signum).name
            self._notice = PreemptionNotice(name, f"received {name}", time.monotonic(), None)
        try:
            os.write(self._signal_pipe[1], b"\x01")
        except (BlockingIOError, OSError, TypeError):
            pass

    def _wake_on_signals(self) -> None:
        while os.read(self._signal_pipe[0], 64):  # empty: stop() closed the write end
            self._noticed.set()

    def _start_thread(self, name: str, target, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run_poller(self, poll_once) -> None:
        while not self._stop.is_set() and self._notice is None:
            waited = False
            try:
                waited = bool(poll_once())
            except (OSError, ValueError) as exc:  # no metadata server, timeout, bad answer
                logger.debug("metadata poll failed: %r", exc)
            if self._notice is not None:
                return
            if not waited:
                self._stop.wait(self.poll_interval_secs)

    # -- AWS --------------------------------------------------------------------------------------

    def _aws_request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        request = urllib.request.Request(self.aws_endpoint + path, method=method, headers=headers)
        try:
            with _OPENER.open(request, timeout=self.request_timeout_secs) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _poll_aws(self) -> None:
        self.polls["aws-spot"] += 1
        if self._aws_token is None:
            status, body = self._aws_request(
                "PUT", AWS_TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECS)}
            )
            if status != 200:
                raise OSError(f"IMDSv2 token request to {self.aws_endpoint} answered {status}")
            self._aws_token = body.decode("ascii").strip()
        status, body = self._aws_request("GET", AWS_INSTANCE_ACTION_PATH, {"X-aws-ec2-metadata-token": self._aws_token})
        if status == 401:
            self._aws_token = None  # expired: renew at the next poll
            return
        if status == 404:
            return
        if status != 200:
            raise OSError(f"spot instance-action at {self.aws_endpoint} answered {status}")
        notice = json.loads(body)
        action, when = notice.get("action"), notice.get("time")
        self.notify("aws-spot", f"action={action} time={when}", _monotonic_of(when))

    # -- GCE --------------------------------------------------------------------------------------

    def _poll_gce(self) -> bool:
        self.polls["gce"] += 1
        url = self.gce_endpoint + GCE_PREEMPTED_PATH
        timeout = self.request_timeout_secs
        if self.gce_wait_for_change:
            wait_secs = max(1, int(self.poll_interval_secs))
            url += f"?wait_for_change=true&timeout_sec={wait_secs}"
            timeout += wait_secs
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with _OPENER.open(request, timeout=timeout) as response:
            value = response.read().decode("ascii").strip()
        if value.upper() == "TRUE":
            self.notify("gce", "preempted=TRUE", time.monotonic() + GCE_NOTICE_SECS)
        return self.gce_wait_for_change  # the hanging GET already waited


def _monotonic_of(when: Any) -> float | None:
    """AWS's ISO-8601 UTC ``time`` as a ``time.monotonic()`` deadline (``None`` if unparsable)."""
    if not isinstance(when, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return time.monotonic() + (moment - dt.datetime.now(dt.timezone.utc)).total_seconds()


__all__ = [
    "AWS_METADATA_ENDPOINT",
    "GCE_METADATA_ENDPOINT",
    "PreemptionNotice",
    "PreemptionWatcher",
]
