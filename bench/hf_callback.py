"""Time per Hugging Face ``on_save``: the Trainer's own local save, and StoreCallback on top of it.

    python -m bench.hf_callback                    # tiny TRL GKD run and a 256 MiB state, local and moto S3
    python -m bench.hf_callback --sizes tiny --saves 3

For each state (``tiny``: the TRL GKD run of ``opd_store.job._trl_demo``, about 60 KB per checkpoint;
``256mib``: a plain ``transformers.Trainer`` fully fine-tuning a Llama of ~22 M parameters, so model
plus AdamW state is about 256 MiB) and each store (a local directory, moto S3 over loopback), the
run saves every step and a timing callback on each side of :class:`StoreCallback` measures, per
save: the Trainer's local save (``on_step_end`` to the first ``on_save``) and the time the callback
blocks training in ``on_save`` (synchronous: upload and commit; asynchronous: the hard-link
snapshot, the upload running in the background; its time to the commit is reported too). The run
saves every step, so for the asynchronous rows the previous upload is waited for, untimed, before
each step's save: the figure is what a save costs when the training between two saves outlasts an
upload, the normal case; a run that saves faster than it uploads waits at the next save instead. Medians
over the saves after the first, printed as markdown with the ratios and written to
``bench/results/hf-callback-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback


class Clock(TrainerCallback):
    """Marks ``on_step_end`` and ``on_save``; placed first (``side='before'``) and last."""

    def __init__(self, marks: dict, side: str, drain=None) -> None:
        self.marks, self.side, self.drain = marks, side, drain

    def on_step_end(self, args, state, control, **kwargs):
        if self.side == "before":
            if self.drain is not None:
                self.drain()  # as if training between saves outlasted the upload (not timed)
            self.marks.setdefault(state.global_step, {})["step_end"] = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        mark = self.marks.setdefault(state.global_step, {})
        mark[f"save_{self.side}"] = time.perf_counter()
        mark[f"save_{self.side}_unix"] = time.time()


def _big_trainer(out: str, steps: int, callbacks: list):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32))
    data = [{"input_ids": torch.arange(16) % 512, "labels": torch.arange(16) % 512} for _ in range(64)]
    args = TrainingArguments(output_dir=out, max_steps=steps, save_steps=1, per_device_train_batch_size=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10_000, save_total_limit=2,
                             )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def _tiny_trainer(out: str, steps: int, callbacks: list):
    from opd_store.job._trl_demo import GKDSpec, build_trainer

    return build_trainer(out, GKDSpec(max_steps=steps, save_steps=1, save_total_limit=2), callbacks=callbacks,
                         logging_steps=10_000)


def measure(size: str, store: str | None, options: dict, mode: str, saves: int) -> dict:
    """One run; returns medians (seconds) of local save, callback block and async commit time."""
    from opd_store.integrations.transformers import StoreCallback

    marks: dict = {}
    store_cb = None
    if store is not None:
        store_cb = StoreCallback(store, storage_options=options, async_upload=(mode == "async"))
    callbacks: list = [Clock(marks, "before", drain=store_cb.wait if mode == "async" else None)]
    if store_cb is not None:
        callbacks.append(store_cb)
    callbacks.append(Clock(marks, "after"))
    with tempfile.TemporaryDirectory() as out:
        trainer = (_big_trainer if size == "256mib" else _tiny_trainer)(out, saves, callbacks)
        trainer.train()
        commit_secs = []
        if store_cb is not None and mode == "async":
            # the background upload and commit: from on_save's return to the manifest's commit time
            from opd_store import CheckpointStore

            committed = CheckpointStore(store, storage_options=options)
            commit_secs = [committed.manifest(step).created_at.timestamp() - mark["save_after_unix"]
                           for step, mark in sorted(marks.items()) if step > 1 and "save_after_unix" in mark]
        ckpt = Path(out) / f"checkpoint-{saves}"
        size_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    rows = [m for step, m in sorted(marks.items()) if step > 1 and "save_before" in m]
    local = statistics.median(m["save_before"] - m["step_end"] for m in rows)
    blocked = statistics.median(m["save_after"] - m["save_before"] for m in rows)
    return {"local": local, "blocked": blocked, "commit": statistics.median(commit_secs or [0.0]),
            "size_bytes": size_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,256mib")
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--saves", type=int, default=4, help="saves per run (the first is not counted)")
    args = parser.parse_args(argv)
    from opd_testkit.s3 import MotoS3  # the tests' moto server (one definition)

    moto = MotoS3() if "s3" in args.stores.split(",") else None
    lines = [f"# StoreCallback on_save cost, {dt.date.today()}", "",
             "Median seconds per save (saves 2..N of one run each); `local` is the Trainer's own save, "
             "`blocked` the time StoreCallback.on_save holds training, `commit` the background upload and commit.",
             "", "| state | store | mode | checkpoint MiB | local save s | on_save blocked s | blocked / local | async commit s |",
             "|---|---|---|---|---|---|---|---|"]
    try:
        for size in args.sizes.split(","):
            base = measure(size, None, {}, "none", args.saves)
            lines.append(f"| {size} | none | Trainer only | {base['size_bytes'] / 2**20:.2f} | {base['local']:.4f} | 0 | 0 | - |")
            print(lines[-1], flush=True)
            for store_name in args.stores.split(","):
                for mode in ("sync", "async"):
                    with tempfile.TemporaryDirectory() as root:
                        if store_name == "s3":
                            backend = moto.new_backend(bucket="opd-bench")
                            url, options = backend.url, backend.storage_options
                        else:
                            url, options = f"{root}/store", {}
                        result = measure(size, url, options, mode, args.saves)
                    ratio = result["blocked"] / result["local"]
                    commit = f"{result['commit']:.4f}" if mode == "async" else "-"
                    lines.append(f"| {size} | {store_name} | {mode} | {result['size_bytes'] / 2**20:.2f} | "
                                 f"{result['local']:.4f} | {result['blocked']:.4f} | {ratio:.2f}x | {commit} |")
                    print(lines[-1], flush=True)
    finally:
        if moto is not None:
            moto.stop()
    out = Path(__file__).resolve().parent / "results" / f"hf-callback-{dt.date.today()}.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
