"""TRL on-policy distillation on spot capacity: train, lose the machine twice, resume from the bucket.

    python examples/trl_gkd_spot.py --s3-emulator          # a moto S3 server on 127.0.0.1
    python examples/trl_gkd_spot.py --store s3://bucket/run --storage-option endpoint_url=...
    python examples/trl_gkd_spot.py --store ./gkd-store    # any fsspec URL or a local directory

A tiny real ``GKDTrainer`` run (Llama student with a LoRA adapter, frozen teacher, local tokenizer
with a chat template, CPU, no download; the models are ``opd_store.job``'s) checkpoints every 2
steps. What a training script adds is in :func:`train_once`: ``StoreCallback`` among the trainer's
callbacks, and ``store_checkpoint`` as ``resume_from_checkpoint`` (docs/integrations.md).

The run is done once uninterrupted (the reference), then as a spot run: SIGKILLed during training
after its first commit, started again and SIGKILLed while saving a checkpoint (payload objects
written, manifest not yet created), and started a last time to the end. Every start is a new process
with a new empty working directory, HOME and temp dir, so only the store carries state. Exits 0 when
the final adapter, optimizer state and logged losses equal the reference bit for bit, 1 otherwise.
Needs ``pip install "opd_store[hf,s3]"`` (and the ``emulator`` extra for ``--s3-emulator``).
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

EVENT = "@event "  # a child's stdout line carrying one JSON event for the supervisor
MAX_STEPS, SAVE_STEPS = 6, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
SENTENCES = (
    "the spot instance was preempted while the student was learning",
    "a checkpoint is complete when its manifest exists",
    "the teacher scores every rollout of the student",
    "write the payloads first and commit the manifest last",
    "the bucket keeps the checkpoint when the machine is gone",
    "a new machine resumes from the latest complete step",
)


def build_trainer(output_dir: str, callbacks: list):
    """The GKD trainer: the job's tiny student (LoRA) and teacher, 24 chat rows, CPU, seed 0."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from opd_store.job import build_student, build_teacher, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    rows = [{"messages": [{"role": "user", "content": SENTENCES[i % len(SENTENCES)]},
                          {"role": "assistant", "content": SENTENCES[(i + 1) % len(SENTENCES)]}]} for i in range(24)]
    args = GKDConfig(output_dir=output_dir, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, per_device_train_batch_size=2,
                     learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, lmbda=0.5, max_new_tokens=4,
                     use_cpu=True, save_total_limit=1, disable_tqdm=True, dataloader_num_workers=0, max_length=32)
    return GKDTrainer(model=build_student(len(tokenizer), seed=0), teacher_model=build_teacher(len(tokenizer), seed=0),
                      args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=callbacks)


def train_once(store: str | None, options: dict, output_dir: str, emit=lambda event: None) -> dict:
    """One process start: resume from the store's newest complete checkpoint if there is one, then
    train to the end, committing every save. ``store=None`` trains without a store (the reference).
    Returns the final adapter, optimizer state, logged losses and step."""
    import torch
    from transformers import TrainerCallback

    from opd_store.integrations.transformers import StoreCallback, store_checkpoint

    class Reporter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            emit({"event": "step", "step": state.global_step})

    torch.set_num_threads(1)  # the same bits on machines with other core counts
    callbacks = [Reporter()]
    if store is not None:
        callbacks.insert(0, StoreCallback(store, storage_options=options))                      # 1
    trainer = build_trainer(output_dir, callbacks)
    resume = None
    if store is not None:
        resume = store_checkpoint(store, storage_options=options, trainer=trainer)              # 2
        if resume is not None:
            emit({"event": "resumed", "step": int(resume.rsplit("-", 1)[1])})
    trainer.train(resume_from_checkpoint=resume)
    return {
        "adapter": {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad},
        "optimizer": trainer.optimizer.state_dict(),
        "losses": [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry],
        "global_step": trainer.state.global_step,
    }


def differences(reference: dict, candidate: dict) -> list[str]:
    """Every difference between two :func:`train_once` results (empty when bit-identical)."""
    import torch

    def same(a, b) -> bool:
        if torch.is_tensor(a):
            return torch.is_tensor(b) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    return [f"{key} differs" for key in reference if not same(reference[key], candidate[key])]


def fresh_machine(base: Path) -> tuple[dict[str, str], Path]:
    """A new machine for one start: empty working directory, HOME and temp dir; offline."""
    machine = Path(tempfile.mkdtemp(prefix="machine-", dir=base))
    for sub in ("home", "tmp", "work"):
        (machine / sub).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HOME=str(machine / "home"), TMPDIR=str(machine / "tmp"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TRANSFORMERS_VERBOSITY="error", TRL_EXPERIMENTAL_SILENCE="1", PYTHONWARNINGS="ignore")
    return env, machine / "work"


def supervise(store: str, options: dict, base: Path, label: str, *, kill_at_step=None, kill_in_save=False):
    """One start in a fresh machine; SIGKILL it at a step or during a save.
    Returns ``(how it was killed or None, the step it resumed from, its result file or None)``."""
    from opd_store import CheckpointStore

    env, work = fresh_machine(base)
    result = work.parent / "result.pt"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--store", store, "--options", json.dumps(options),
           "--result", str(result)]
    process = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    store_view = CheckpointStore(store, storage_options=options)
    killed, resumed = None, None
    for line in process.stdout:
        event = json.loads(line[len(EVENT):]) if line.startswith(EVENT) else {}
        if event.get("event") == "resumed":
            resumed = event["step"]
        if kill_at_step is not None and event.get("event") == "step" and event["step"] == kill_at_step:
            process.send_signal(signal.SIGKILL)
            killed = f"during training, after step {kill_at_step}"
            break
        if kill_in_save and event.get("event") == "step" and event["step"] % SAVE_STEPS == 0:
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


def child(store: str, options: dict, result: str) -> None:
    import torch

    state = train_once(store, options, "out", emit=lambda event: print(EVENT + json.dumps(event), flush=True))
    torch.save(state, result)


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
        child(args.store, options, args.result)
        return 0
    for item in args.storage_option:
        key, _, value = item.partition("=")
        options[key] = value
    server = None
    if args.s3_emulator:
        from opd_store.job import DemoS3Server  # the S3 server of `opd-store demo --s3-emulator`

        server = DemoS3Server()
        os.environ.update(server.environment())
        server.create_bucket("opd-demo")
        options = server.storage_options()
        args.store = args.store or "s3://opd-demo/gkd"
    if not args.store:
        parser.error("give --store URL or --s3-emulator")
    try:
        import torch

        from opd_store import CheckpointStore

        base = Path(tempfile.mkdtemp(prefix="trl-gkd-spot-"))
        print(f"store: {args.store}   machines under {base}")
        with tempfile.TemporaryDirectory() as out:
            reference = train_once(None, {}, out)
        starts = [supervise(args.store, options, base, "start-1", kill_at_step=3),
                  supervise(args.store, options, base, "start-2", kill_in_save=True),
                  supervise(args.store, options, base, "start-3")]
        for n, (killed, resumed, _result) in enumerate(starts, 1):
            print(f"start {n}: resumed from {resumed if resumed is not None else 'scratch'}; "
                  f"{'SIGKILLed ' + killed if killed else 'ran to the end'}")
        state = torch.load(starts[-1][2], weights_only=True)
        problems = differences(reference, state)
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
