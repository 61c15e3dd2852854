"""TRL on-policy distillation on spot capacity: train, lose the machine twice, resume from the bucket.

    python examples/trl_gkd_spot.py --s3-emulator          # a moto S3 server on 127.0.0.1
    python examples/trl_gkd_spot.py --store s3://bucket/run --storage-option endpoint_url=...
    python examples/trl_gkd_spot.py --store ./gkd-store    # any fsspec URL or a local directory

A tiny real ``GKDTrainer`` run (Llama student with a LoRA adapter, frozen teacher, local tokenizer
with a chat template, CPU, no download; ``opd_store.job._trl_demo``) checkpoints every 2 steps
through ``StoreCallback``. It is run once uninterrupted (the reference), then as a spot run:
SIGKILLed during training after its first commit, started again and SIGKILLed while saving a
checkpoint (payload objects written, manifest not yet created), and started a last time to the end.
Every start is a new process with a new empty working directory, HOME and temp dir, so only the
store carries state. Exits 0 when the final adapter, optimizer state and logged losses equal the
reference bit for bit, 1 otherwise. Needs ``pip install -e ".[hf,s3]"`` (and ``moto[server]`` for
``--s3-emulator``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def _child(store: str, options: dict, out: str, result: str | None) -> None:
    import torch
    from opd_testkit.events import emit

    from opd_store.job._trl_demo import run_start

    state = run_start(store, out, storage_options=options, events=emit)
    if result:
        state.pop("log_history", None)
        torch.save(state, result)


def _start(store, options, base: Path, label: str, *, kill_at_step=None, kill_in_save=False):
    """One start in a fresh "machine"; SIGKILL it at a step or during a save. Returns (killed, resumed, result)."""
    from opd_testkit.events import PREFIX

    from opd_store import CheckpointStore
    from opd_store.job._machines import fresh_machine

    env, work = fresh_machine(base, {"TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONWARNINGS": "ignore"})
    result = work.parent / "result.pt"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--store", store, "--options", json.dumps(options),
           "--result", str(result)]
    process = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    store_view = CheckpointStore(store, storage_options=options)
    killed, resumed = None, None
    for line in process.stdout:
        event = json.loads(line[len(PREFIX):]) if line.startswith(PREFIX) else {}
        if event.get("event") == "resumed":
            resumed = event["step"]
        if kill_at_step is not None and event.get("event") == "step" and event["step"] == kill_at_step:
            process.send_signal(signal.SIGKILL)
            killed = f"during training, after step {kill_at_step}"
            break
        if kill_in_save and event.get("event") == "step" and event["step"] % 2 == 0:
            while process.poll() is None:  # the save of this step is running: catch it mid-upload
                info = {i.step: i for i in store_view.checkpoints()}.get(event["step"])
                if info is not None and info.status == "complete":
                    break
                if info is not None and info.attempts:
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    after = store_view.status(event["step"])
                    killed = (f"during the save of step {event['step']} ({info.total_size_bytes} bytes had landed; "
                              f"step {event['step']} is {after})")
                    break
            if killed:
                break
    process.wait()
    if killed is None and process.returncode != 0:
        raise SystemExit(f"{label} failed with exit code {process.returncode}")
    return killed, resumed, (result if result.exists() else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store URL (default with --s3-emulator: s3://opd-demo/gkd)")
    parser.add_argument("--storage-option", action="append", default=[], help="KEY=VALUE fsspec option (repeatable)")
    parser.add_argument("--s3-emulator", action="store_true", help="run against a moto S3 server on 127.0.0.1")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if args.child:
        _child(args.store, options, "out", args.result)
        return 0
    for item in args.storage_option:
        key, _, value = item.partition("=")
        options[key] = value
    server = None
    if args.s3_emulator:
        from opd_testkit.s3 import MotoS3  # the tests' moto server, as `opd-store demo --s3-emulator`

        server = MotoS3()
        os.environ.update(server.environment())
        server.create_bucket("opd-demo")
        options = server.storage_options()
        args.store = args.store or "s3://opd-demo/gkd"
    if not args.store:
        parser.error("give --store URL or --s3-emulator")
    try:
        import torch

        from opd_store import CheckpointStore
        from opd_store.job._trl_demo import compare_states, run_start

        base = Path(tempfile.mkdtemp(prefix="trl-gkd-spot-"))
        print(f"store: {args.store}   machines under {base}")
        with tempfile.TemporaryDirectory() as out:
            reference = run_start(None, out)
        starts = [_start(args.store, options, base, "start-1", kill_at_step=3),
                  _start(args.store, options, base, "start-2", kill_in_save=True),
                  _start(args.store, options, base, "start-3")]
        for n, (killed, resumed, _result) in enumerate(starts, 1):
            print(f"start {n}: resumed from {resumed if resumed is not None else 'scratch'}; "
                  f"{'SIGKILLed ' + killed if killed else 'ran to the end'}")
        final = starts[-1][2]
        state = torch.load(final, weights_only=True)
        problems = compare_states(reference, state)
        store = CheckpointStore(args.store, storage_options=options)
        print(f"steps in the store: {store.steps()}; final step {state['global_step']}; "
              f"losses {'equal' if state['losses'] == reference['losses'] else 'DIFFERENT'}")
        print("bit for bit equal to the uninterrupted run" if not problems else "MISMATCH: " + "; ".join(problems))
        return 0 if not problems else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
