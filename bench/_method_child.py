"""One save and one load by one method, in a fresh process; prints JSON on stdout.

    python -m bench._method_child --method NAME --backend local|s3 --size-mib N --root ROOT --tag T \
        [--storage-options JSON] [--moto-pid PID] [--verify]

``bench.run`` calls :func:`measure_one` in a process forked from itself instead (importing torch
in a new interpreter took over a minute on the loaded shared machine); the command line runs the
same function in a new interpreter.

Per phase (save, then load): wall seconds, CPU seconds of this process (all threads), CPU seconds of
the moto server (``--moto-pid``), and peak RSS (VmHWM, reset to the current RSS just before the
phase with ``echo 5 > /proc/self/clear_refs``), with the RSS before the phase for reference. With
``cold_load`` (``--cold-load``), a local load reads from disk: every file under the method's root
is dropped from the page cache first (``fsync`` + ``posix_fadvise(DONTNEED)``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import drop_file_cache, proc_status_kib, reset_peak_rss  # noqa: E402
from bench.methods import BY_NAME, loaded_as_state, make_training_state, same_state, state_nbytes  # noqa: E402
from opd_store.job._machines import process_cpu_secs  # noqa: E402


def phase(fn, moto_pid: int | None) -> tuple[dict, object]:
    gc.collect()
    before = proc_status_kib("VmRSS")
    reset_ok = reset_peak_rss()
    server0 = process_cpu_secs(moto_pid) if moto_pid else 0.0
    cpu0 = process_cpu_secs()
    started = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - started
    out = {
        "wall": wall,
        "cpu": process_cpu_secs() - cpu0,
        "server": (process_cpu_secs(moto_pid) - server0) if moto_pid else 0.0,
        "rss_before_kib": before,
        "peak_kib": proc_status_kib("VmHWM"),
        "hwm_reset": reset_ok,
    }
    return out, result


def _drop_tree_from_page_cache(root: str) -> None:
    for directory, _dirs, files in os.walk(root):
        for name in files:
            drop_file_cache(os.path.join(directory, name))


def measure_one(method_name: str, backend: str, size_mib: int, root: str, tag: int, options: dict,
                moto_pid: int | None, verify: bool = True, cold_load: bool = False, registry: dict | None = None) -> dict:
    """Build the state, save it, load it back; readings as described in the module docstring.

    ``registry`` maps method names to classes (default: :data:`bench.methods.BY_NAME`); ``moto_pid``
    is the S3 server's process, whichever server it is."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    import torch  # noqa: F401 - imported before the baseline reading

    method = (registry or BY_NAME)[method_name](backend, root, options)
    method.connect()
    gc.collect()
    out: dict = {"method": method_name, "backend": backend, "size_mib": size_mib, "tag": tag, "pid": os.getpid()}
    out["baseline_kib"] = proc_status_kib("VmRSS")
    state = make_training_state(size_mib)
    out["state_bytes"] = state_nbytes(state)
    gc.collect()
    out["with_state_kib"] = proc_status_kib("VmRSS")
    if hasattr(method, "prepare"):
        method.prepare(state)  # untimed (the async method's staging buffers)
        gc.collect()
        out["with_state_kib"] = proc_status_kib("VmRSS")
    started = time.perf_counter()
    out["save"], _ = phase(lambda: method.save(state, tag), moto_pid)
    if hasattr(method, "finish"):
        method.finish()  # the background write and commit of an asynchronous save
        out["save_total"] = time.perf_counter() - started
    if cold_load and backend == "local":
        _drop_tree_from_page_cache(root)
    out["load"], loaded = phase(lambda: method.load(state, tag), moto_pid)
    if verify:
        out["verified"] = same_state(state, loaded_as_state(method_name, loaded, state))
    del loaded
    method.cleanup(tag)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=sorted(BY_NAME), required=True)
    parser.add_argument("--backend", choices=("local", "s3"), required=True)
    parser.add_argument("--size-mib", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--tag", type=int, required=True)
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--moto-pid", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="compare the loaded state with the saved one")
    parser.add_argument("--cold-load", action="store_true", help="local: load from disk, not the page cache")
    args = parser.parse_args()
    out = measure_one(args.method, args.backend, args.size_mib, args.root, args.tag,
                      json.loads(args.storage_options), args.moto_pid or None, args.verify, args.cold_load)
    print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
