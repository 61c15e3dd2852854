"""Hundreds of ranks on one machine: virtual ranks through opd_store's own multi-rank and DCP
write paths, for the suite's small-N test and ``python -m bench.simulation``.

A virtual rank is a thread with a store of its own (its own client, connections, part pool and
pacer, as a process of a real job has), so the requests the store sees are the ones a real save
of that many ranks sends; the ranks meet in a fake process group (:class:`SimGroup`: ``rank``,
``world_size``, ``all_gather``, ``broadcast``, what :mod:`opd_store.pipeline._collective` takes).
Two write paths:

* ``collective``: :func:`opd_store.pipeline.run_save_collective` (rank 0 ``begin`` s, every other
  rank writes its part with ``begin_part`` and seals it, rank 0 adds the parts' entries and creates
  the manifest);
* ``dcp``: :class:`opd_store.dcp.StoreWriter` driven as ``torch.distributed.checkpoint`` drives it
  (DCP's own ``DefaultSavePlanner``: local plans, the coordinator's global plan and
  ``prepare_global_plan``, ``write_data`` on every rank, ``finish`` on the coordinator), the
  collectives DCP would run done by the fake group.

State is scaled down with the part size, so the requests are not: a rank of ``state_bytes`` in
parts of ``part_size_bytes`` sends as many ``UploadPart`` s as a real rank of ``state_bytes x
(16 MiB / part_size_bytes)`` in 16 MiB parts. Parts below S3's 5 MiB need a server that accepts
them: moto with ``S3_UPLOAD_PART_MIN_SIZE`` lowered (:func:`moto_min_part_env`; the in-process
server of the tests: :func:`lower_moto_min_part`); the stores are told the same minimum
(``TransferSettings.min_part_size_bytes``).

Ranks run as threads of this process (``processes=1``) or of several spawned processes, whose
collectives go through a hub in this one (:class:`_Hub`): a 512-rank save on a 2-core machine is
client-bound, and two processes use both cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
import traceback
from typing import Any, Iterator

COLLECTIVE = "collective"
DCP = "dcp"


@dataclasses.dataclass(frozen=True)
class SimSpec:
    """One simulated save.

    Attributes:
        world_size (int): virtual ranks.
        step (int): the step saved.
        state_bytes (int): bytes each rank writes (scaled down with ``part_size_bytes``).
        part_size_bytes (int): the stores' part size (and smallest part).
        parts_in_flight (int): each rank's ``parts_in_flight``.
        key_layout (str): ``step`` or ``spread`` (the storage option).
        key_prefixes (int): spread prefixes.
        path (str): ``collective`` or ``dcp``.
        throttle_timeout_secs (float): each rank's ``throttle_timeout_secs``.
        processes (int): processes the ranks run in (1: threads of this process).
        pacing (bool): each rank's store paces its uploads (``False``: a pacer that never slows
            down, only the client's retries and the part writer's: what a store without pacing sends).
    """

    world_size: int
    step: int = 1
    state_bytes: int = 256 << 10
    part_size_bytes: int = 64 << 10
    parts_in_flight: int = 4
    key_layout: str = "step"
    key_prefixes: int = 16
    path: str = COLLECTIVE
    throttle_timeout_secs: float = 300.0
    processes: int = 1
    pacing: bool = True

    def storage_options(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (endpoint, credentials) with this spec's layout and transfer options."""
        options = dict(base, parts_in_flight=self.parts_in_flight, throttle_timeout_secs=self.throttle_timeout_secs,
                       key_layout=self.key_layout)
        if self.key_layout != "step":
            options["key_prefixes"] = self.key_prefixes
        return options


@dataclasses.dataclass
class RankOutcome:
    """What one virtual rank saw.

    Attributes:
        rank (int): the rank.
        secs (float): from the start signal to the end of its save (rank 0: the commit and the
            after-commit stage).
        error (str | None): ``Type: message`` when its save raised.
        throttled_answers (int), retries (int), throttled_secs (float): its store's pacer during
            the save (:class:`opd_store.storage.transfers.PacerStats`).
        url (str | None): the committed URL (every rank gets it from the collectives).
    """

    rank: int
    secs: float
    error: str | None
    throttled_answers: int
    retries: int
    throttled_secs: float
    url: str | None


@dataclasses.dataclass
class SimResult:
    """A simulated save.

    Attributes:
        spec (SimSpec): what ran.
        ranks (list[RankOutcome]): every rank's outcome, by rank.
        setup_secs (float): opening every rank's store and client (before the start signal).
    """

    spec: SimSpec
    ranks: list[RankOutcome]
    setup_secs: float

    @property
    def url(self) -> str | None:
        return self.ranks[0].url

    @property
    def errors(self) -> dict[int, str]:
        return {o.rank: o.error for o in self.ranks if o.error}

    @property
    def commit_secs(self) -> float:
        """Rank 0's time: from the start signal to its commit (and after-commit stage)."""
        return self.ranks[0].secs

    def total(self, field: str) -> float:
        """The sum of a :class:`RankOutcome` field over the ranks."""
        return sum(getattr(o, field) for o in self.ranks)


# -- the fake process group -------------------------------------------------------------------------


class _Rendezvous:
    """Collectives of the virtual ranks of this process; through ``hub`` (a connection to the
    parent's :class:`_Hub`) with the other processes' ranks."""

    def __init__(self, world_size: int, local_ranks: list[int], hub=None) -> None:
        self.world_size = world_size
        self.local = set(local_ranks)
        self._hub = hub
        self._cond = threading.Condition()
        self._values: dict[int, Any] = {}
        self._round = 0
        self._results: dict[int, list[Any]] = {}
        self._readers: dict[int, int] = {}

    def all_gather(self, rank: int, value: Any) -> list[Any]:
        with self._cond:
            current = self._round
            self._values[rank] = value
            if len(self._values) == len(self.local):
                values, self._values = self._values, {}
                if self._hub is not None:
                    self._hub.send(values)
                    values = self._hub.recv()
                self._results[current] = [values[r] for r in range(self.world_size)]
                self._readers[current] = len(self.local)
                self._round += 1
                self._cond.notify_all()
            else:
                while self._round == current:
                    self._cond.wait()
            result = self._results[current]
            self._readers[current] -= 1
            if not self._readers[current]:
                del self._results[current], self._readers[current]
            return result


class SimGroup:
    """One virtual rank's process group (what :mod:`opd_store.pipeline._collective` takes).

    Attributes:
        rank (int), world_size (int): its place.
    """

    def __init__(self, rendezvous: _Rendezvous, rank: int) -> None:
        self._rendezvous = rendezvous
        self.rank = rank
        self.world_size = rendezvous.world_size

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (every rank calls it)."""
        return self._rendezvous.all_gather(self.rank, value)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return self.all_gather(value if self.rank == 0 else None)[0]


def thread_groups(world_size: int) -> list[SimGroup]:
    """The groups of ``world_size`` virtual ranks in threads of this process."""
    rendezvous = _Rendezvous(world_size, list(range(world_size)))
    return [SimGroup(rendezvous, rank) for rank in range(world_size)]


class _Hub(threading.Thread):
    """The parent's side of the processes' collectives: each round, every process's values in,
    the merged values out to every process."""

    def __init__(self, connections: list) -> None:
        super().__init__(name="sim-hub", daemon=True)
        self._connections = connections

    def run(self) -> None:
        try:
            while True:
                merged: dict[int, Any] = {}
                for connection in self._connections:
                    merged.update(connection.recv())
                for connection in self._connections:
                    connection.send(merged)
        except (EOFError, OSError):
            return


# -- one rank's save ---------------------------------------------------------------------------------


def _open_rank_store(spec: SimSpec, url: str, options: dict[str, Any]):
    """A store of one virtual rank: its own client (built now), the spec's scaled parts."""
    from opd_store import CheckpointStore
    from opd_store.storage.transfers import Pacer, Transfers, TransferSettings

    store = CheckpointStore(url, storage_options=spec.storage_options(options))
    settings = store.storage.transfers.settings
    store.storage.transfers = Transfers(dataclasses.replace(
        settings, part_size_bytes=spec.part_size_bytes, min_part_size_bytes=spec.part_size_bytes))
    if not spec.pacing:
        store.storage.transfers.pacer = Pacer(spec.parts_in_flight, throttle_timeout_secs=spec.throttle_timeout_secs,
                                              adaptive=False)
    connect = getattr(store.storage.fs, "connect", None)
    if connect is not None:
        connect()  # the client, before the timed save
    return store


def rank_payload(rank: int, size_bytes: int) -> bytes:
    """The bytes rank ``rank`` saves (its rank, repeated: cheap to make and to check)."""
    return bytes([rank % 251]) * size_bytes


def _collective_save(spec: SimSpec, store, group: SimGroup) -> str | None:
    from opd_store.pipeline import AfterCommit, SaveRequest, run_save_collective

    rank = group.rank
    data = rank_payload(rank, spec.state_bytes)

    def write(txn, shared: bool) -> None:
        with txn.open(f"shard-{rank:05d}.bin") as writer:
            writer.write(data)
        if shared:
            txn.write_bytes("config.json", b'{"simulated": true}')

    def prepare() -> SaveRequest:
        return SaveRequest(after=AfterCommit(store, spec.step), world_size=group.world_size,
                           metadata={"simulated_ranks": group.world_size}, write=write)

    return run_save_collective(group, prepare)


def _dcp_save(spec: SimSpec, store, group: SimGroup) -> str | None:
    """One rank of ``dcp.save`` with :class:`opd_store.dcp.StoreWriter`, DCP's collectives done by
    ``group`` (the calls ``torch.distributed.checkpoint``'s ``_save_state_dict`` makes)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from opd_store.dcp import StoreWriter

    rank = group.rank
    state = {f"layers.{rank}.weight": torch.full((spec.state_bytes // 4,), float(rank), dtype=torch.float32)}
    writer = StoreWriter(store, spec.step)
    planner = DefaultSavePlanner()
    coordinator = rank == 0
    writer.reset(writer.checkpoint_id)
    planner.set_up_planner(state, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    plans = group.all_gather(local_plan)
    central = None
    if coordinator:
        global_plans, metadata = planner.create_global_plan(plans)
        central = (writer.prepare_global_plan(global_plans), metadata)
    global_plans, metadata = group.broadcast(central)
    plan = planner.finish_plan(global_plans[rank])
    results = writer.write_data(plan, planner).wait()
    all_results = group.all_gather(results)
    error = None
    if coordinator:
        try:
            writer.finish(metadata, all_results)
            writer.run_after_commit()
        except Exception as exc:  # noqa: BLE001 - every rank hears it below
            error = f"{type(exc).__name__}: {exc}"
    outcome = group.broadcast((writer.committed_url, error))
    if outcome[1] is not None:
        raise RuntimeError(f"rank 0 failed to commit: {outcome[1]}")
    return outcome[0]


def _save_as_rank(spec: SimSpec, store, group: SimGroup, started: float) -> RankOutcome:
    before = store.storage.transfers.pacer.stats()
    url, error = None, None
    try:
        url = (_dcp_save if spec.path == DCP else _collective_save)(spec, store, group)
    except Exception as exc:  # noqa: BLE001 - reported in the outcome
        error = f"{type(exc).__name__}: {exc}"
        if os.environ.get("OPD_SIM_TRACEBACKS"):
            traceback.print_exc()
    secs = time.perf_counter() - started
    after = store.storage.transfers.pacer.stats()
    return RankOutcome(group.rank, secs, error, after.throttled_answers - before.throttled_answers,
                       after.retries - before.retries, after.throttled_secs - before.throttled_secs, url)


def _import_save_path(spec: SimSpec) -> None:
    """Import what a save runs (the write path and its lazy imports) before the start signal: a
    freshly spawned process importing them under the clock made the first save of a run seconds
    slower than the next ones."""
    import opd_store.pipeline  # noqa: F401 - imported for its side effect: loaded before the clock
    if spec.path == DCP:
        import torch.distributed.checkpoint.default_planner  # noqa: F401

        import opd_store.dcp  # noqa: F401


def _run_ranks(spec: SimSpec, url: str, options: dict[str, Any], ranks: list[int],
               rendezvous: _Rendezvous) -> tuple[list[RankOutcome], float]:
    """Open the ranks' stores, meet the other ranks, then save on one thread per rank."""
    _import_save_path(spec)
    started_setup = time.perf_counter()
    stores = {rank: _open_rank_store(spec, url, options) for rank in ranks}
    setup_secs = time.perf_counter() - started_setup
    groups = {rank: SimGroup(rendezvous, rank) for rank in ranks}
    outcomes: dict[int, RankOutcome] = {}
    lock = threading.Lock()

    def body(rank: int) -> None:
        groups[rank].all_gather(None)  # the start signal: every rank of every process is ready
        outcome = _save_as_rank(spec, stores[rank], groups[rank], time.perf_counter())
        with lock:
            outcomes[rank] = outcome

    threads = [threading.Thread(target=body, args=(rank,), name=f"sim-rank-{rank}", daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcomes[rank] for rank in ranks], setup_secs


def _process_main(spec: SimSpec, url: str, options: dict[str, Any], ranks: list[int], hub, out) -> None:
    """A spawned process's ranks (its options get this process's aiobotocore session)."""
    from .stores import aio_session

    try:
        rendezvous = _Rendezvous(spec.world_size, ranks, hub)
        outcomes, setup = _run_ranks(spec, url, dict(options, session=aio_session()), ranks, rendezvous)
        out.send((outcomes, setup))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.send(RuntimeError(f"simulation process of ranks {ranks[0]}-{ranks[-1]} failed: {exc!r}\n"
                              + traceback.format_exc()))


def simulate(spec: SimSpec, url: str, storage_options: dict[str, Any]) -> SimResult:
    """Run ``spec`` against the store at ``url`` (every rank opens its own store with
    ``storage_options`` and the spec's options).

    Raises:
        RuntimeError: a simulation process failed outside a save (a rank's failing save is
            reported in its :class:`RankOutcome`).
    """
    if spec.processes <= 1:
        ranks = list(range(spec.world_size))
        outcomes, setup = _run_ranks(spec, url, storage_options, ranks, _Rendezvous(spec.world_size, ranks))
        return SimResult(spec, outcomes, setup)
    context = multiprocessing.get_context("spawn")
    shares = [list(range(spec.world_size))[i::spec.processes] for i in range(spec.processes)]
    shares = [sorted(share) for share in shares if share]
    hub_ends, results, processes = [], [], []
    options = {k: v for k, v in storage_options.items() if k != "session"}
    for share in shares:
        parent_hub, child_hub = context.Pipe()
        parent_out, child_out = context.Pipe(duplex=False)
        process = context.Process(target=_process_main, args=(spec, url, options, share, child_hub, child_out),
                                  daemon=True)
        process.start()
        hub_ends.append(parent_hub)
        results.append(parent_out)
        processes.append(process)
    _Hub(hub_ends).start()
    outcomes: list[RankOutcome] = []
    setup = 0.0
    for out, process in zip(results, processes):
        received = out.recv()
        process.join()
        if isinstance(received, BaseException):
            raise received
        outcomes += received[0]
        setup = max(setup, received[1])
    return SimResult(spec, sorted(outcomes, key=lambda o: o.rank), setup)


# -- the server's smallest part ----------------------------------------------------------------------


def moto_min_part_env(part_size_bytes: int) -> dict[str, str]:
    """Environment of a moto process (:class:`opd_testkit.s3.MotoProcess`) accepting parts of
    ``part_size_bytes`` (moto's ``S3_UPLOAD_PART_MIN_SIZE``; S3's is 5 MiB)."""
    return {"S3_UPLOAD_PART_MIN_SIZE": str(part_size_bytes)}


@contextlib.contextmanager
def lower_moto_min_part(part_size_bytes: int) -> Iterator[None]:
    """moto in this process (:class:`opd_testkit.s3.MotoS3`) accepts parts of ``part_size_bytes``
    while the block runs (moto reads ``S3_UPLOAD_PART_MIN_SIZE`` once, into its S3 models)."""
    from moto.s3 import models

    before = models.S3_UPLOAD_PART_MIN_SIZE
    models.S3_UPLOAD_PART_MIN_SIZE = part_size_bytes
    try:
        yield
    finally:
        models.S3_UPLOAD_PART_MIN_SIZE = before


__all__ = ["COLLECTIVE", "DCP", "RankOutcome", "SimGroup", "SimResult", "SimSpec", "lower_moto_min_part",
           "moto_min_part_env", "rank_payload", "simulate", "thread_groups"]
