"""``save``, ``load`` and ``async_save``: DCP with opd_store's storage and opd_store's errors.

Beyond ``dcp.save(..., storage_writer=StoreWriter(store, step))``: the committed URL as result, a
failed save's attempt discarded, the after-commit stage on the coordinator, and DCP's
``CheckpointException`` (ranks -> errors) turned into the same typed error on every rank
(docs/sharded.md, "The storage layer", has the table): a save, ``DistributedSaveError`` (or
``DistributedCommitConflictError``) naming each failing rank, one process its own error; a load,
the ranks' shared error itself (``IncompleteCheckpointError``, ``IntegrityError``), that class
naming each rank when messages differ, else ``DistributedLoadError``. No tensor has changed then.
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
    """The opd_store error of a failed DCP save: the one process's own error, else
    :func:`~opd_store.pipeline.save_failure`'s.
    """
    failures = _failures(exc)
    if world_size == 1 and len(failures) == 1:
        return next(iter(failures.values()))
    return save_failure(url, step, {rank: describe_failure(error) for rank, error in failures.items()})


def load_error(exc: CheckpointException, *, url: str, step: int,
               metadata_error: BaseException | None = None) -> BaseException:
    """The opd_store error of a failed DCP load; ``metadata_error`` is this rank's typed error from
    ``read_metadata`` (which DCP reports as an ``AssertionError``).
    """
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
    """``dcp.save`` of ``state_dict`` as step ``step`` of ``store``, then (coordinator) the save's
    after-commit stage; returns the committed URL.

    Args:
        state_dict (dict): what ``dcp.save`` takes (DTensors, tensors, objects, ``Stateful`` values).
        store (BaseStore | str | os.PathLike): a store or its URL.
        step (int): a step not committed yet.
        storage_options (dict | None): fsspec options for a URL.
        process_group: the group saving together (DCP's ``process_group``).
        planner: DCP's ``SavePlanner`` (plan caching works: the attempt id is broadcast).
        metadata, mesh_shape, extra_payloads, after_commit, extensions: see ``StoreWriter``.

    Rank obligations: every rank of ``process_group`` (default: the default group, or this process
    alone) calls it with the same store and step.

    Raises:
        DistributedSaveError: (an ``OSError``) a rank failed; nothing committed; on every rank.
        DistributedCommitConflictError: (a ``FileExistsError``) the step is already committed.
        RetentionError: (coordinator, plain store) committed, and the retention pass failed.
        Exception: without a process group, the process's own error (``CommitConflictError``, ...).
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
    ``single_process`` this process loads alone. ``extension_registry``: see ``StoreReader``.

    Raises (on every rank, before any tensor of ``state_dict`` changed):
        IncompleteCheckpointError, IntegrityError, DistributedLoadError: see the module docstring.
        StreamTransformError: items written through a transform this reader cannot apply.
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
        staged (Future[None]): done once the state is copied to host memory (the training may then
            change its tensors).
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
    """``dcp.async_save``: returns once DCP staged ``state_dict`` (or, with an asynchronous stager,
    once staging began); ``staged`` says when tensors may change, ``committed`` resolves to the URL
    or raises :func:`save`'s errors.

    ``async_checkpointer_type``: DCP's ``AsyncCheckpointerType`` (default ``THREAD``); ``PROCESS``
    writes from DCP's ``spawn``-ed background process, the writer pickled as its store's address
    (``memory://`` and tiered stores refused: ``TypeError`` from ``committed``). docs/sharded.md,
    "Asynchronous saves in another process"; measured: docs/performance.md.

    Rank obligations: as :func:`save`; ``process_group`` should be used by nothing else while the
    save runs (its collectives run on DCP's background thread); wait for ``committed`` before the
    next save.
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
