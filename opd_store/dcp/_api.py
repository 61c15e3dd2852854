"""``save``, ``load`` and ``async_save``: DCP with opd_store's storage and opd_store's errors.

Plain ``dcp.save(..., storage_writer=StoreWriter(store, step))`` works; these functions add what a
caller of opd_store expects: the committed URL as the result, a discarded attempt when the save
fails, the save's after-commit stage on the coordinator (``after_commit``), and DCP's
``CheckpointException`` (a ``BaseException`` whose ``failures`` map ranks to errors) turned into
opd_store's typed errors, the same on every rank:

* a save that failed anywhere raises :class:`~opd_store.errors.DistributedSaveError` (or
  :class:`~opd_store.errors.DistributedCommitConflictError` when the step was already committed),
  naming each failing rank and its error; a single process raises its own error;
* a load that failed raises the failing ranks' error itself when they all failed the same way
  (an :class:`~opd_store.errors.IncompleteCheckpointError` for a missing or truncated rank file, an
  :class:`~opd_store.errors.IntegrityError` for a checksum mismatch: each naming step, rank and
  file), an error of that class naming each failing rank when they failed with one opd_store error
  class but different messages, and :class:`~opd_store.errors.DistributedLoadError` otherwise.
  Every check runs before DCP reads (:mod:`opd_store.dcp._reader`): no tensor has changed.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from typing import Any, Sequence

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import DistributedLoadError, OpdStoreError
from ..pipeline import AfterCommit, describe_failure, save_failure
from ..store import BaseStore
from ._reader import StoreReader
from ._writer import ExtraPayloads, StoreWriter


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_size(process_group: Any) -> int:
    if not _distributed():
        return 1
    return dist.get_world_size(process_group)


def _failures(exc: CheckpointException) -> dict[int, BaseException]:
    return {int(rank): (wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            for rank, wrapped in exc.failures.items()}


def _text(failures: dict[int, BaseException]) -> dict[int, str]:
    return {rank: f"{type(error).__name__}: {error}" for rank, error in sorted(failures.items())}


def _cause(error: BaseException, wrapper: CheckpointException) -> BaseException:
    """The cause to chain to ``error``: its own when it is a rank's error raised as it is (the
    backend's error stays its ``__cause__``, DCP's wrapper its context), else DCP's wrapper."""
    return error.__cause__ if error.__cause__ is not None else wrapper


def save_error(exc: CheckpointException, *, url: str, step: int, world_size: int) -> BaseException:
    """The opd_store error of a failed DCP save (see the module docstring): the one process's own
    error, else the multi-rank save's :func:`~opd_store.pipeline.save_failure`."""
    failures = _failures(exc)
    if world_size == 1 and len(failures) == 1:
        return next(iter(failures.values()))
    return save_failure(url, step, {rank: describe_failure(error) for rank, error in failures.items()})


def load_error(exc: CheckpointException, *, url: str, step: int,
               metadata_error: BaseException | None = None) -> BaseException:
    """The opd_store error of a failed DCP load (see the module docstring); ``metadata_error`` is
    this rank's typed error from ``read_metadata``, which DCP reports as an ``AssertionError``."""
    failures = _failures(exc)
    if metadata_error is not None:
        failures = {rank: metadata_error if isinstance(error, AssertionError) and str(metadata_error) in str(error)
                    else error for rank, error in failures.items()}
    text = _text(failures)
    distinct = {(type(error), str(error)) for error in failures.values()}
    if len(distinct) == 1:
        error = next(iter(failures.values()))
        error.failures = text
        return error
    classes = {type(error) for error in failures.values()}
    summary = "; ".join(f"rank {r} failed: {t}" for r, t in text.items())
    if len(classes) == 1 and issubclass(next(iter(classes)), OpdStoreError):
        error = next(iter(classes))(f"{url}: step {step} could not be loaded: {summary}")
        error.failures = text
        return error
    return DistributedLoadError.from_failures(f"{url}: step {step} could not be loaded on {len(failures)} rank(s): "
                                              f"{summary}", text)


def save(state_dict: dict[str, Any], store: BaseStore | str | os.PathLike, step: int, *,
         storage_options: dict[str, Any] | None = None, process_group: Any = None, planner: Any = None,
         metadata: dict[str, Any] | None = None, mesh_shape: list[int] | None = None,
         extra_payloads: ExtraPayloads | None = None, after_commit: AfterCommit | None = None,
         extensions: Sequence[Any] | None = None) -> str:
    """``dcp.save`` of ``state_dict`` as step ``step`` of ``store``, then (the coordinator) the
    save's after-commit stage; returns the committed URL.

    Rank obligations: every rank of ``process_group`` (default: the default group, or this
    process alone without one) calls it with the same store and step.

    Args:
        state_dict (dict): what ``dcp.save`` takes (DTensors of a sharded model, tensors, objects,
            ``Stateful`` values).
        store (BaseStore | str | os.PathLike): a store or its URL.
        step (int): a step not committed yet.
        storage_options (dict | None): fsspec options for a URL.
        process_group: the group saving together (DCP's ``process_group``).
        planner: DCP's ``SavePlanner`` (default ``DefaultSavePlanner``; plan caching works: the
            attempt id reaches every rank by a broadcast on ``process_group``).
        metadata, mesh_shape, extra_payloads, after_commit, extensions: see
            :class:`~opd_store.dcp._writer.StoreWriter`.

    Raises:
        DistributedSaveError: (an ``OSError``) a rank failed; nothing committed; on every rank.
        DistributedCommitConflictError: (a ``FileExistsError``) the step is already committed.
        RetentionError: (the coordinator, plain store) the step committed and its retention pass
            failed.
        The single process's own error without a process group (``CommitConflictError``, ...).
    """
    writer = StoreWriter(store, step, storage_options=storage_options, metadata=metadata, mesh_shape=mesh_shape,
                         extra_payloads=extra_payloads, after_commit=after_commit, extensions=extensions,
                         process_group=process_group)
    world_size = _group_size(process_group)
    try:
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                 no_dist=not _distributed())
    except CheckpointException as exc:
        writer.abort()
        error = save_error(exc, url=writer.checkpoint_id, step=step, world_size=world_size)
        raise error from _cause(error, exc)
    writer.run_after_commit()
    return writer.checkpoint_id


def load(state_dict: dict[str, Any], store: BaseStore | str | os.PathLike, step: int, *,
         storage_options: dict[str, Any] | None = None, process_group: Any = None, planner: Any = None,
         single_process: bool = False, extension_registry: Any = None) -> None:
    """``dcp.load`` of step ``step`` of ``store`` into ``state_dict`` (in place, resharded).

    Rank obligations: every rank of ``process_group`` calls it with the same store and step; with
    ``single_process`` this process loads alone (no collectives, even under a process group).
    ``extension_registry``: see :class:`~opd_store.dcp._reader.StoreReader`.

    Raises:
        IncompleteCheckpointError, IntegrityError, DistributedLoadError, ...: see the module
            docstring; raised on every rank before any tensor of ``state_dict`` changed.
        StreamTransformError: items written through a stream transform this reader cannot apply.
        CheckpointNotFoundError: the step is not committed.
    """
    reader = StoreReader(store, step, storage_options=storage_options, extension_registry=extension_registry)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                 no_dist=single_process or not _distributed())
    except CheckpointException as exc:
        error = load_error(exc, url=reader.checkpoint_id, step=step, metadata_error=reader.metadata_error)
        raise error from _cause(error, exc)


@dataclasses.dataclass
class AsyncSave:
    """A save in flight (:func:`async_save`).

    Attributes:
        staged (Future[None]): done once the state is copied to host memory: the training may then
            change its tensors (already done when the stager stages synchronously, the default).
        committed (Future[str]): the committed URL, or :func:`save`'s errors.
    """

    staged: Future
    committed: Future

    def result(self, timeout: float | None = None) -> str:
        """The committed URL (waits up to ``timeout`` seconds); raises the save's error."""
        return self.committed.result(timeout=timeout)


def async_save(state_dict: dict[str, Any], store: BaseStore | str | os.PathLike, step: int, *,
               storage_options: dict[str, Any] | None = None, process_group: Any = None, planner: Any = None,
               metadata: dict[str, Any] | None = None, async_stager: Any = None,
               extra_payloads: ExtraPayloads | None = None, extensions: Sequence[Any] | None = None,
               async_checkpointer_type: Any = None) -> AsyncSave:
    """``dcp.async_save``: returns once DCP staged ``state_dict`` (CPU copies), or, with an
    asynchronous stager (``DefaultStager(StagingOptions(use_pinned_memory=True,
    use_async_staging=True, ...))``: pinned host buffers, copies on a side stream), once staging
    began; ``staged`` says when the tensors may change, ``committed`` resolves to the URL or
    raises :func:`save`'s errors.

    ``async_checkpointer_type``: DCP's ``AsyncCheckpointerType`` (default ``THREAD``). ``PROCESS``
    writes from DCP's background process (started with ``spawn`` on the first such save, with a
    gloo group of its own; it needs a process group here, and ``MASTER_ADDR`` where the host name
    does not resolve): the writer reaches it pickled as its store's address (a ``memory://`` or
    tiered store is refused, ``TypeError`` from ``committed``), the commit is the same, and a
    failure comes back from ``committed`` as the same typed error; an attempt a failed process
    save opened is left to ``opd-store gc``. Measured against ``THREAD``: docs/performance.md.

    Rank obligations: as :func:`save`; ``process_group`` should be a group used by nothing else
    while the save runs (its collectives run on DCP's background thread), e.g.
    ``dist.new_group(backend="gloo")``; wait for ``committed`` before the next save (DCP's
    background process serves one save at a time).
    """
    writer = StoreWriter(store, step, storage_options=storage_options, metadata=metadata,
                         extra_payloads=extra_payloads, extensions=extensions, process_group=process_group)
    world_size = _group_size(process_group)
    kwargs: dict[str, Any] = {} if async_stager is None else {"async_stager": async_stager}
    if async_checkpointer_type is not None:
        kwargs["async_checkpointer_type"] = async_checkpointer_type
    response = dcp.async_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                              **kwargs)
    upload = getattr(response, "upload_completion", response)
    staged = getattr(response, "staging_completion", None)
    if staged is None:
        staged = Future()
        staged.set_result(None)
    result: Future = Future()

    def settle(done: Future) -> None:
        try:
            done.result()
        except CheckpointException as exc:
            writer.abort()
            result.set_exception(save_error(exc, url=writer.checkpoint_id, step=step, world_size=world_size))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            writer.abort()
            result.set_exception(exc)
        else:
            result.set_result(writer.checkpoint_id)

    upload.add_done_callback(settle)
    return AsyncSave(staged=staged, committed=result)


__all__ = ["AsyncSave", "async_save", "load", "load_error", "save", "save_error"]
