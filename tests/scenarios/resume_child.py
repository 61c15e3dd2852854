"""A fresh process that resumes from a store URL: ``python resume_child.py URL OPTIONS_JSON``.

Finds the latest complete checkpoint under URL, restores the tiny student's adapter and the OPD
state into new objects, and prints one JSON line: the checkpoint URL it resumed from, the
restored counters, and a SHA-256 of the restored adapter tensors.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from opd_store import latest_complete_checkpoint
from scenarios.helpers import adapter_tensors, load, student, trainable


def main(url: str, options: dict) -> None:
    latest = latest_complete_checkpoint(url, storage_options=options)
    model = student()
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = load(latest, model=model, optimizer=optimizer, scheduler=scheduler, storage_options=options)
    digest = hashlib.sha256()
    for name, tensor in sorted(adapter_tensors(model).items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    print(json.dumps({"latest": latest, "successful_updates": state["successful_updates"],
                      "adapter_sha256": digest.hexdigest()}))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
