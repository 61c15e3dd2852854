"""What a fork server imports before it forks, and the environment it imports it under.

A child forked from the server finds these modules already imported: the imports of torch,
transformers and peft (several CPU seconds in a fresh interpreter) are paid once per server.
"""

from __future__ import annotations

# What a test's child needs most: the job (torch, transformers, peft), the store with every client.
REQUIRED_PRELOAD = (
    "opd_store",
    "opd_store.cli",
    "opd_store.job._train",
    "opd_store.job._models",
    "opd_store.opd",
    "opd_store.opd",
    "opd_store.runtime",
    "opd_testkit.stores",
    "s3fs",
    "gcsfs",
    "peft",
    "transformers",
)
# The trainers of the integrations' children (tests/integrations: a TRL GKD run, a transformers
# Trainer on two ranks, a Lightning Trainer), imported when their extras (hf, lightning) are
# installed: about 0.5 CPU-seconds more per server, against several per child without them.
TRAINER_PRELOAD = (
    "transformers.trainer",
    "accelerate",
    "datasets",
    "trl.experimental.gkd",
    "lightning.pytorch",
    "opd_store.integrations.transformers",
    "opd_store.integrations.lightning",
    "opd_store.job._trl_demo",
    "opd_testkit.events",
)
OPTIONAL = "?"
"""A preload name ending in it is imported only when installed (``ModuleNotFoundError`` ignored)."""
DEFAULT_PRELOAD = REQUIRED_PRELOAD + tuple(name + OPTIONAL for name in TRAINER_PRELOAD)
# Read at import by huggingface_hub and transformers; set as opd_store's fresh machines set them.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TRL_EXPERIMENTAL_SILENCE": "1"}


def import_preload(preload: tuple[str, ...] | list[str]) -> None:
    """Import every module named in ``preload`` (a name ending in :data:`OPTIONAL` only when installed).

    Raises:
        ModuleNotFoundError: a required (not :data:`OPTIONAL`) module is not installed.
        Exception: whatever a module raises while it is imported.
    """
    import importlib

    for name in preload:
        try:
            importlib.import_module(name.removesuffix(OPTIONAL))
        except ModuleNotFoundError:
            if not name.endswith(OPTIONAL):
                raise
    if "s3fs" in preload:
        # Parsed once here rather than by every child's first S3 store (about 0.1 CPU-second each).
        from opd_store.storage.s3._session import load_s3_data

        load_s3_data()
