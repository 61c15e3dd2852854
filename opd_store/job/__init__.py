"""The main job (``opd-store train``, ``opd-store demo``): a tiny real on-policy distillation run
that checkpoints to a store and resumes on a fresh machine. Its models (a tiny Llama student with a
LoRA adapter, a frozen teacher, a local tokenizer; no download) are public for examples and tests.
Each name is imported on first use (torch, transformers)."""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._demo import run_demo
    from ._emulator import DemoS3Server
    from ._models import build_student, build_teacher, build_tokenizer
    from ._train import train

_EXPORTS = {
    "DemoS3Server": "._emulator",
    "build_student": "._models",
    "build_teacher": "._models",
    "build_tokenizer": "._models",
    "run_demo": "._demo",
    "train": "._train",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
