"""The save/load methods that ``python -m bench`` compares, one class per method.

Every method saves and loads the same training state (:func:`make_training_state`) on one backend:

=================  ==============================================================================
``raw``            the limit: the tensors' bytes written straight to the backend, no serialisation.
                   local: ``write`` of every tensor's memoryview into one file, 512 KiB per ``write(2)``
                   (the fastest size here), + ``fsync``; load:
                   ``readinto`` the storage of freshly allocated tensors. S3: one s3fs file
                   (``fs.open(path, "wb")``, multipart) written the same way; load: one GET
                   (``fs.cat_file``) and ``torch.frombuffer`` views of it.
``torch.save``     the baseline, plain ``torch.save`` with no store: ``torch.save(state, path)`` +
                   ``fsync`` (local, torch's C++ file writer) or ``torch.save`` into an s3fs file;
                   load ``torch.load(path)`` / ``torch.load(BytesIO(fs.cat_file(path)))`` (one GET).
``seed``           the seed's method (local only; ``/work/shared/seeds``): ``torch.save`` into a
                   staging directory ``.tmp-step-NNNNNN-<uuid>``, a ``COMPLETE`` marker file, then
                   ``rename`` to ``step-NNNNNN``. No fsync (the seed has none). Load: check
                   ``COMPLETE``, ``torch.load(path, map_location="cpu", weights_only=False)``.
``dcp``            ``torch.distributed.checkpoint.save/load`` with its fsspec ``FsspecWriter`` /
                   ``FsspecReader`` (torch 2.13 keeps them in the private module
                   ``torch.distributed.checkpoint._fsspec_filesystem``), no process group (a single
                   process: ``no_dist``). Local: ``sync_files=True`` (fsync, like the others); S3:
                   ``sync_files=False`` (an s3fs file has no descriptor, so DCP would fall back to a
                   machine-wide ``os.sync()``). Load fills a template state of empty tensors in place
                   (DCP's contract); building the template is timed too.
``opd_store``      a transaction: ``store.begin(step)`` / ``txn.open(name)`` /
                   ``opd_store.format._torch_io.torch_save(state, writer)`` / commit (CRC32C while
                   streaming, fsync, create-only manifest); load ``store.open`` (size + CRC32C
                   checked) + ``torch.load``.
``opd_store-zipcrc``  the same with torch's own zip CRC-32 left on (a plain ``torch.save`` into
                   the writer): the side-by-side measurement behind ``torch_io``'s choice.
``opd_store-mmap``  the same save; load maps the verified local file
                   (``opd_store.format._torch_io.torch_load(reader, mmap=True)``): tensors share the page
                   cache instead of being copied (local only).
``opd_store-async``  the asynchronous save's blocking time (its *save* column): the state is
                   staged into reusable host buffers (``StagingBuffers``, as ``AsyncCheckpointer``
                   does; allocated by an untimed first staging, as after a job's first save),
                   then the opd_store save runs in a thread; ``save_total`` times until its commit.
                   Its load is opd_store's.
=================  ==============================================================================
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from typing import Any

MIB = 2**20
N_TENSORS = 64
PAYLOAD = "state.pt"
SLICE_BYTES = 8 * MIB
LOCAL_WRITE_BYTES = 512 * 1024

METHODS = ("raw", "torch.save", "seed", "dcp", "opd_store", "opd_store-mmap", "opd_store-async", "opd_store-zipcrc")
LOCAL_ONLY = {"seed", "opd_store-mmap"}


# -- the state -----------------------------------------------------------------------------------
def make_training_state(size_mib: int, n_tensors: int = N_TENSORS, seed: int = 0) -> dict:
    """A model of ``n_tensors`` float32 tensors plus an SGD-momentum optimizer state of the same
    shapes, ``size_mib`` MiB of tensor data in all (half model, half optimizer).

    Values: one random block plus a per-tensor offset (fast to build; no two tensors equal).
    """
    import torch

    numel = size_mib * MIB // (2 * n_tensors) // 4
    base = torch.rand(numel, generator=torch.Generator().manual_seed(seed))
    model = {f"layer.{i:02d}.weight": base + i for i in range(n_tensors)}
    optimizer = {
        "state": {i: {"momentum_buffer": base - i} for i in range(n_tensors)},
        "param_groups": [{"lr": 0.01, "momentum": 0.9, "params": list(range(n_tensors))}],
    }
    return {"model": model, "optimizer": optimizer}


def flat_tensors(state: dict) -> list:
    """Every tensor of a training state, in a fixed order."""
    model = list(state["model"].values())
    optim = [state["optimizer"]["state"][i]["momentum_buffer"] for i in sorted(state["optimizer"]["state"])]
    return model + optim


def template_like(state: dict) -> dict:
    """The state's structure with empty tensors (what DCP loads into)."""
    import torch

    return {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "optimizer": {
            "state": {i: {"momentum_buffer": torch.empty_like(s["momentum_buffer"])}
                      for i, s in state["optimizer"]["state"].items()},
            "param_groups": [dict(g) for g in state["optimizer"]["param_groups"]],
        },
    }


def state_nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(state))


def same_state(a: dict, b: dict) -> bool:
    """First and last tensors equal, same tensor count (a cheap check that a load round-tripped)."""
    import torch

    ta, tb = flat_tensors(a), flat_tensors(b)
    return len(ta) == len(tb) and torch.equal(ta[0], tb[0]) and torch.equal(ta[-1], tb[-1])


def _views(tensors) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in tensors]


# -- methods -------------------------------------------------------------------------------------
class Method:
    """One way to save and load the state on one backend.

    ``root`` is a local directory or ``s3://bucket/prefix``; ``options`` the s3fs options.
    """

    name = "?"

    def __init__(self, backend: str, root: str, options: dict | None = None) -> None:
        self.backend = backend
        self.root = root.rstrip("/")
        self.options = dict(options or {})
        self.fs = None
        if backend == "s3":
            import s3fs

            self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        else:
            os.makedirs(self.root, exist_ok=True)

    def connect(self) -> None:
        """Open connections before timing (each method pays its client set-up outside the clock)."""
        if self.fs is not None:
            self.fs.connect()
            self.fs.ls(self.root.removeprefix("s3://").split("/", 1)[0])

    def key(self, tag: int, suffix: str) -> str:
        return f"{self.root.removeprefix('s3://')}/{self.name}-{tag}{suffix}"

    def save(self, state: dict, tag: int) -> None:
        raise NotImplementedError

    def load(self, state_template: dict, tag: int) -> Any:
        raise NotImplementedError

    def cleanup(self, tag: int) -> None:
        raise NotImplementedError


class Raw(Method):
    name = "raw"

    def save(self, state, tag):
        views = _views(flat_tensors(state))
        if self.fs is None:
            path = self.key(tag, ".bin")
            with open(path, "wb", buffering=0) as handle:
                for view in views:
                    # The fastest write size measured here (bench/results/write-size-2026-11-30.md):
                    # whole 8 MiB storages per write(2) cost 15-20x the CPU on Linux 6.18.
                    for offset in range(0, view.nbytes, LOCAL_WRITE_BYTES):
                        handle.write(view[offset : offset + LOCAL_WRITE_BYTES])
                os.fsync(handle.fileno())
        else:
            with self.fs.open(self.key(tag, ".bin"), "wb") as handle:
                for view in views:
                    for offset in range(0, view.nbytes, SLICE_BYTES):
                        handle.write(view[offset : offset + SLICE_BYTES])

    def load(self, state_template, tag):
        import torch

        shapes = [t.shape for t in flat_tensors(state_template)]
        if self.fs is None:
            out = [torch.empty(shape) for shape in shapes]
            with open(self.key(tag, ".bin"), "rb", buffering=0) as handle:
                for tensor in out:
                    view = memoryview(tensor.numpy()).cast("B")
                    got = 0
                    while got < view.nbytes:
                        got += handle.readinto(view[got:])
            return out
        data = self.fs.cat_file(self.key(tag, ".bin"))
        out, offset = [], 0
        for shape in shapes:
            count = shape.numel()
            out.append(torch.frombuffer(data, dtype=torch.float32, count=count, offset=offset).view(shape))
            offset += count * 4
        return out

    def cleanup(self, tag):
        _remove(self.fs, self.key(tag, ".bin"))


class TorchSave(Method):
    name = "torch.save"

    def save(self, state, tag):
        import torch

        path = self.key(tag, ".pt")
        if self.fs is None:
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            with self.fs.open(path, "wb") as handle:
                torch.save(state, handle)

    def load(self, state_template, tag):
        import torch

        path = self.key(tag, ".pt")
        if self.fs is None:
            return torch.load(path)
        return torch.load(io.BytesIO(self.fs.cat_file(path)))

    def cleanup(self, tag):
        _remove(self.fs, self.key(tag, ".pt"))


class Seed(Method):
    """The seed's ``save_opd_checkpoint`` write pattern, reduced to the one state payload."""

    name = "seed"

    def _final(self, tag: int) -> str:
        return os.path.join(self.root, f"step-{tag:06d}")

    def save(self, state, tag):
        import torch

        final = self._final(tag)
        if os.path.exists(final):
            raise FileExistsError(final)
        temporary = os.path.join(self.root, f".tmp-step-{tag:06d}-{uuid.uuid4().hex}")
        os.mkdir(temporary)
        torch.save(state, os.path.join(temporary, "training_state.pt"))
        with open(os.path.join(temporary, "COMPLETE"), "w", encoding="utf-8") as handle:
            handle.write("complete\n")
        os.rename(temporary, final)

    def load(self, state_template, tag):
        import torch

        final = self._final(tag)
        if not os.path.isfile(os.path.join(final, "COMPLETE")):
            raise ValueError(f"OPD checkpoint is incomplete: {final}")
        return torch.load(os.path.join(final, "training_state.pt"), map_location="cpu", weights_only=False)

    def cleanup(self, tag):
        shutil.rmtree(self._final(tag), ignore_errors=True)


class Dcp(Method):
    name = "dcp"

    def _url(self, tag: int) -> str:
        if self.fs is None:
            return "file://" + os.path.join(self.root, f"dcp-{tag}")
        return f"{self.root}/dcp-{tag}"

    def _fs_kwargs(self) -> dict:
        return dict(self.options) if self.fs is not None else {}

    def save(self, state, tag):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(self._url(tag), sync_files=self.fs is None, **self._fs_kwargs())
        dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, state_template, tag):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        target = template_like(state_template)
        dcp.load(target, storage_reader=FsspecReader(self._url(tag), **self._fs_kwargs()), no_dist=True)
        return target

    def cleanup(self, tag):
        if self.fs is None:
            shutil.rmtree(os.path.join(self.root, f"dcp-{tag}"), ignore_errors=True)
        else:
            try:
                self.fs.rm(self._url(tag).removeprefix("s3://"), recursive=True)
            except FileNotFoundError:
                pass


class Store(Method):
    name = "opd_store"
    zip_crc32 = False

    def __init__(self, backend, root, options=None):
        super().__init__(backend, root, options)
        from opd_store import CheckpointStore

        self.store = CheckpointStore(os.path.join(self.root, "store") if backend == "local" else f"{self.root}/store",
                                     storage_options=self.options or None)

    def connect(self):
        if self.backend == "s3":
            self.store.storage.fs.connect()
            self.store.steps()

    def save(self, state, tag):
        import torch

        from opd_store.format import torch_save

        with self.store.begin(tag) as txn:
            with txn.open(PAYLOAD) as writer:
                if self.zip_crc32:
                    torch.save(state, writer)
                else:
                    torch_save(state, writer)

    mmap = False

    def load(self, state_template, tag):
        from opd_store.format import torch_load

        with self.store.open(tag, PAYLOAD) as handle:
            return torch_load(handle, mmap=self.mmap)

    def cleanup(self, tag):
        self.store.delete(tag)


class StoreZipCrc(Store):
    name = "opd_store-zipcrc"
    zip_crc32 = True


class StoreMmap(Store):
    """The same save; the load maps the verified local file (``torch_load(reader, mmap=True)``)."""

    name = "opd_store-mmap"
    mmap = True


class StoreAsync(Store):
    """The asynchronous save's blocking time: ``save`` returns once the state is staged.

    Staging is :class:`opd_store.opd._async_save.StagingBuffers` (what ``AsyncCheckpointer`` does
    while training waits); the write and commit then run in a thread, and :meth:`finish` waits for
    them (timed apart as ``save_total``). :meth:`prepare` stages once before the clock: a training
    job's earlier saves have already allocated the buffers (steady state, as
    ``bench/async_save.py`` reports apart from the first save).
    """

    name = "opd_store-async"

    def prepare(self, state):
        from opd_store.opd._async_save import StagingBuffers

        self.buffers = StagingBuffers()
        self.buffers.begin()
        self.buffers.stage(state)
        self.buffers.finish()

    def save(self, state, tag):
        import threading

        self.buffers.begin()
        snapshot = self.buffers.stage(state)
        self.buffers.finish()
        self._error = None

        def write():
            try:
                Store.save(self, snapshot, tag)
            except BaseException as exc:  # noqa: BLE001 - raised by finish()
                self._error = exc

        self._thread = threading.Thread(target=write, name="bench-async-save")
        self._thread.start()

    def finish(self):
        self._thread.join()
        if self._error is not None:
            raise self._error


def _remove(fs, path: str) -> None:
    try:
        if fs is None:
            os.unlink(path)
        else:
            fs.rm_file(path)
    except FileNotFoundError:
        pass


BY_NAME: dict[str, type[Method]] = {
    "raw": Raw,
    "torch.save": TorchSave,
    "seed": Seed,
    "dcp": Dcp,
    "opd_store": Store,
    "opd_store-zipcrc": StoreZipCrc,
    "opd_store-mmap": StoreMmap,
    "opd_store-async": StoreAsync,
}


def loaded_as_state(method: str, loaded: Any, template: dict) -> dict:
    """Put a method's load result in the state's shape (raw loads return a flat tensor list)."""
    if method != "raw":
        return loaded
    n = len(template["model"])
    return {
        "model": dict(zip(template["model"], loaded[:n])),
        "optimizer": {"state": {i: {"momentum_buffer": t} for i, t in enumerate(loaded[n:])}, "param_groups": []},
    }
