"""One rank of the multi-rank rows of test_core_write_errors.py and test_core_damage.py: a real
process in a gloo group.

Run as ``python core_rank_child.py SPEC_JSON`` (rank, world size, file rendezvous, ``out``, and):

* ``url``, ``storage_options`` and ``steps``: ``[step, big]`` pairs to save, one per backend failure
  the test armed in its proxy for that step; every rank saves each step in multi-rank mode (rank 0
  the shared payloads and ``rng-rank-00.pt``, rank 1 ``rng-rank-01.pt``; ``big`` adds a 6 MiB tensor);
* ``resumes``: store URLs to resume from as a multi-rank job does (``latest_complete_checkpoint``,
  then ``load_opd_checkpoint`` on every rank).

Each rank writes ``<out>/rank-<r>.json``: per step (``"save <step>"``) or store (``"resume <url>"``)
the URL or the error's type, the classes it is, its message, its ``failures`` and its causes' types.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from opd_testkit import forkserver


def describe(exc: BaseException) -> dict:
    causes, cause = [], exc.__cause__
    while cause is not None:
        causes.append(type(cause).__name__)
        cause = cause.__cause__
    return {"type": type(exc).__name__, "bases": [cls.__name__ for cls in type(exc).__mro__], "message": str(exc),
            "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()}, "causes": causes}


def run_ranks(out: Path, world_size: int = 2, **spec) -> list[dict]:
    """Two ranks of core_rank_child.py with ``spec``; each rank's report, index = rank."""
    out.mkdir(parents=True, exist_ok=True)
    init_method = f"file://{out / f'rendezvous-{uuid.uuid4().hex}'}"
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "testkit"),
                                                       os.environ.get("PYTHONPATH", "")]))
    child = Path(__file__)
    procs = [forkserver.popen([sys.executable, str(child), json.dumps(dict(
        rank=rank, world_size=world_size, init_method=init_method, out=str(out), **spec))],
        env=env, stdout=forkserver.PIPE, stderr=forkserver.STDOUT, text=True) for rank in range(world_size)]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    reports = []
    for rank, log in enumerate(logs):
        path = out / f"rank-{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report:\n{log[-4000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank, world_size = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    from opd_testkit import opd as objects

    from opd_store import CheckpointStore, save_opd_checkpoint
    from opd_store.opd import latest_complete_checkpoint, load_opd_checkpoint

    results = {}
    for step, big in spec.get("steps", []):
        store = CheckpointStore(spec["url"], storage_options=spec["storage_options"])
        teacher = {"update_count": step, **({"big": torch.zeros(3 << 19)} if big else {})}  # 6 MiB: multipart
        try:
            results[f"save {step}"] = {"url": save_opd_checkpoint(**objects.save_kwargs(store, successful=step,
                                                                                          teacher_state=teacher))}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[f"save {step}"] = describe(exc)
    for url in spec.get("resumes", []):
        kwargs = objects.load_kwargs()
        kwargs.update(rank=None, world_size=None)  # the process group's
        try:
            latest = latest_complete_checkpoint(url)
            results[f"resume {url}"] = {"latest": latest,
                                        "step": load_opd_checkpoint(latest, **kwargs)["successful_updates"]}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[f"resume {url}"] = describe(exc)
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as handle:
        json.dump(results, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
