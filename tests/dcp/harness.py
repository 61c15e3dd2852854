"""One launch of N real gloo ranks that runs many sharded-checkpoint scenarios in turn.

Every process start costs seconds of imports on a loaded 2-core machine, so a test starts this
launcher once (``python tests/dcp/harness.py SPEC_PATH``, a child of the worker's preloaded fork
server, :mod:`opd_testkit.forkserver`, which has imported torch, DCP, PEFT and opd_store): it
imports the spec's scenario module, then forks N rank processes (``fork`` after the imports, before any thread or
process group exists) that join one gloo group through a ``FileStore`` under the test's tmp
directory (no port to race for under ``pytest -n``). Each rank runs the spec's scenarios in order
(functions ``scenario_<name>(ctx)`` of the spec's module) and writes ``rank-<r>.json``: a dict
from scenario name to what it observed, or to ``{"error": ..., "traceback": ...}``.

Subgroups stand in for other world sizes: ``ctx.prefix_group(w)`` is ranks ``0..w-1`` of the
launch (created collectively at start), so one 8-rank launch saves at 1, 2, 4 and 8 ranks and loads
each on the others.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

from opd_testkit.stores import Backend, open_store, use_emulator_environment

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the scenario modules and sharded_models
use_emulator_environment()  # before anything imports gcsfs or botocore

PREFIX_SIZES = (1, 2, 4, 8)


class Context:
    """What a scenario gets: its rank, the launch's groups, the store and a results dict."""

    def __init__(self, spec: dict, rank: int) -> None:
        import torch.distributed as dist

        self.spec, self.rank, self.world_size = spec, rank, spec["world_size"]
        self.backend = Backend.from_json(spec["backend"])
        self.out = Path(spec["out"])
        self._groups = {}
        self._store = None
        for size in PREFIX_SIZES:  # collective: every rank creates every group in the same order
            if size < self.world_size:
                self._groups[size] = dist.new_group(list(range(size)), backend="gloo")
        self._groups[self.world_size] = dist.group.WORLD

    def prefix_group(self, size: int):
        """The process group of ranks ``0..size-1`` (``None`` for a rank outside it)."""
        return self._groups[size] if self.rank < size else None

    def store(self):
        """This rank's :class:`~opd_store.CheckpointStore` on the launch's backend, opened on first
        use and kept, as a job's process keeps its store: a new S3 client per call cost each rank
        about 0.15 CPU-s for its TLS context (the CA bundle parsed), even on an ``http://`` endpoint."""
        if self._store is None:
            self._store = open_store(self.backend)
        return self._store

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "bases": [c.__name__ for c in type(exc).__mro__],
            "failures": {str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()},
            "traceback": traceback.format_exc()}


def _rank_main(spec: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['out']}/rendezvous", rank=rank,
                            world_size=spec["world_size"],
                            timeout=datetime.timedelta(seconds=spec.get("timeout_secs", 120)))
    module = importlib.import_module(spec["module"])
    ctx = Context(spec, rank)
    results: dict = {}
    code = 0
    for name in spec["scenarios"]:
        started = time.perf_counter()
        try:
            results[name] = getattr(module, f"scenario_{name}")(ctx) or {}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[name] = {"error": _error(exc)}
            code = 1
        results[name]["seconds"] = round(time.perf_counter() - started, 3)
        (Path(spec["out"]) / f"rank-{rank}.json").write_text(json.dumps(results, default=str))
        if code:
            break  # a failed collective scenario leaves the group unusable
    os._exit(code)  # no interpreter teardown: a rank a scenario killed on purpose is not waited on


def launch(spec: dict) -> dict:
    """Run ``spec`` (``world_size``, ``module``, ``scenarios``, ``backend``, ``out``) in this
    process's forked children; returns ``{"exit_codes": [...], "seconds": ...}``."""
    importlib.import_module(spec["module"])  # the heavy imports, once, before forking
    context = multiprocessing.get_context("fork")
    started = time.perf_counter()
    ranks = [context.Process(target=_rank_main, args=(spec, rank)) for rank in range(spec["world_size"])]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + spec.get("launch_timeout_secs", 600)
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    return {"exit_codes": [process.exitcode for process in ranks], "seconds": time.perf_counter() - started}


def run_launch(spec: dict, tmp: Path, timeout_secs: float = 900) -> list[dict]:
    """From a test: write ``spec``, run this launcher in a child of the fork server, return each
    rank's results (rank 0's ``_launch``: the launch summary, and the end of the launcher's and
    ranks' stderr as ``stderr``).

    Raises:
        AssertionError: the launcher failed; its output and every rank's results are in the message.
        subprocess.TimeoutExpired: it ran past ``timeout_secs`` (the launcher is killed).
    """
    from opd_testkit import forkserver

    tmp.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out=str(tmp))
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    root = HERE.parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = forkserver.run([sys.executable, str(Path(__file__)), str(path)], capture_output=True, text=True,
                          timeout=timeout_secs, env=env)
    results = []
    for rank in range(spec["world_size"]):
        file = tmp / f"rank-{rank}.json"
        results.append(json.loads(file.read_text()) if file.exists() else {})
    summary = json.loads((tmp / "launch.json").read_text()) if (tmp / "launch.json").exists() else {}
    assert done.returncode == 0 and summary, f"launcher failed ({done.returncode}):\n{done.stderr[-6000:]}"
    results[0]["_launch"] = dict(summary, stderr=done.stderr[-6000:])  # the ranks' own output (they inherit it)
    return results


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    summary = launch(spec)
    (Path(spec["out"]) / "launch.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
