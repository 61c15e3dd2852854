"""Restoring the student's LoRA adapter in place, exactly, and rebuilding the saved processor."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointNotFoundError
from ..store import COMPLETE, ReadableStore
from ._names import ADAPTER_DIR, PROCESSOR_DIR, PROCESSOR_MARKERS, CheckpointRef, open_checkpoint
from ._safe_load import load_payload

DCP_METADATA = ".metadata"  # a sharded (DCP) checkpoint; opd_store.dcp._metadata_io.METADATA_NAME


def _adapter_weights(store: ReadableStore, step: int, names: list[str], prefix: str, url: str) -> dict:
    safetensors_name = f"{prefix}adapter_model.safetensors"
    bin_name = f"{prefix}adapter_model.bin"
    if safetensors_name in names:
        from safetensors.torch import load as load_safetensors

        return load_safetensors(store.read(step, safetensors_name))
    if bin_name in names:
        return load_payload(store.read(step, bin_name), source=f"{url}/{bin_name}")
    raise CheckpointNotFoundError(f"{url} has no adapter weights ({safetensors_name} or {bin_name})")


def _restore_peft_adapter(store: ReadableStore, step: int, names: list[str], model: Any, url: str) -> None:
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping) or not peft_config:
        raise TypeError(
            f"load_adapter restores PEFT adapters in place; {type(model).__name__} has no peft_config"
        )
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    for adapter_name in peft_config:
        prefix = f"{ADAPTER_DIR}/" if adapter_name == "default" else f"{ADAPTER_DIR}/{adapter_name}/"
        saved = _adapter_weights(store, step, names, prefix, url)
        expected = get_peft_model_state_dict(model, adapter_name=adapter_name)
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"adapter {adapter_name!r} at {url} does not fit the model: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        mismatched = [
            f"{key}: saved {tuple(saved[key].shape)} {saved[key].dtype}, model "
            f"{tuple(expected[key].shape)} {expected[key].dtype}"
            for key in sorted(expected)
            if saved[key].shape != expected[key].shape or saved[key].dtype != expected[key].dtype
        ]
        if mismatched:
            raise ValueError(f"adapter {adapter_name!r} at {url} has mismatched tensors: {mismatched}")
        set_peft_model_state_dict(model, saved, adapter_name=adapter_name)
        restored = get_peft_model_state_dict(model, adapter_name=adapter_name)
        differing = sorted(key for key in saved if not torch.equal(restored[key].detach().cpu(), saved[key]))
        if differing:
            raise ValueError(f"adapter {adapter_name!r} from {url} did not restore exactly: {differing}")


def _processor_class(name: str | None) -> Any:
    """A processor class named in the manifest, looked up in ``transformers``'s namespace only."""
    if not name:
        return None
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # noqa: BLE001 - transformers' lazy module raises ImportError for missing extras
        return None
    bases = tuple(
        base
        for base in (
            getattr(transformers, "PreTrainedTokenizerBase", None),
            getattr(transformers, "ProcessorMixin", None),
            getattr(transformers, "FeatureExtractionMixin", None),
            getattr(transformers, "ImageProcessingMixin", None),
        )
        if base is not None
    )
    if isinstance(cls, type) and bases and issubclass(cls, bases) and hasattr(cls, "from_pretrained"):
        return cls
    return None


def _load_processor(store: ReadableStore, step: int, names: list[str], url: str, class_name: str | None) -> Any:
    prefix = f"{PROCESSOR_DIR}/"
    chosen = [name for name in names if name.startswith(prefix)]
    if not chosen:
        # A legacy step: the seed's save_adapter wrote the processor beside the adapter.
        adapter_prefix = f"{ADAPTER_DIR}/"
        if not any(f"{adapter_prefix}{marker}" in names for marker in PROCESSOR_MARKERS):
            return None
        prefix = adapter_prefix
        chosen = [name for name in names if name.startswith(prefix) and "/" not in name[len(prefix):]]
    import transformers

    with tempfile.TemporaryDirectory(prefix="opd-processor-") as tmp:
        for name in chosen:
            target = Path(tmp, *name[len(prefix):].split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(store.read(step, name))
        cls = _processor_class(class_name)
        if cls is not None:
            return cls.from_pretrained(tmp, local_files_only=True)
        errors = []
        for auto in (transformers.AutoProcessor, transformers.AutoTokenizer):
            try:
                return auto.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
            except (ValueError, OSError, KeyError, TypeError) as exc:
                errors.append(f"{auto.__name__}: {exc}")
        raise ValueError(f"cannot load the processor saved at {url}: {'; '.join(errors)}")


def _restore_from_shards(store: ReadableStore, step: int, model: Any, url: str) -> None:
    """Gather a sharded (DCP) checkpoint's adapter into this process's unsharded PEFT model: one
    process, no collectives; the full tensors are copied in and compared bit for bit.

    Raises:
        TypeError: ``model`` is not a PEFT model.
        ValueError: missing or unexpected keys, mismatched tensors, or an inexact restore.
    """
    from .. import dcp
    from ..dcp import StoreReader

    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping) or not peft_config:
        raise TypeError(f"load_adapter restores PEFT adapters in place; {type(model).__name__} has no peft_config")
    saved = {key[len("model."):]: meta for key, meta in StoreReader(store, step).read_metadata()
             .state_dict_metadata.items() if key.startswith("model.")}
    params = dict(model.named_parameters())
    adapter = {name for name in params if any(f".{adapter_name}." in name for adapter_name in peft_config)}
    missing, unexpected = sorted(adapter - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(f"adapter at {url} does not fit the model: missing keys {missing}, unexpected keys {unexpected}")
    mismatched = [f"{name}: saved {tuple(meta.size)} {meta.properties.dtype}, model {tuple(params[name].shape)} "
                  f"{params[name].dtype}" for name, meta in sorted(saved.items())
                  if tuple(meta.size) != tuple(params[name].shape) or meta.properties.dtype != params[name].dtype]
    if mismatched:
        raise ValueError(f"adapter at {url} has mismatched tensors: {mismatched}")
    gathered = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for name, meta in saved.items()}
    dcp.load({"model": gathered}, store, step, single_process=True)
    with torch.no_grad():
        for name, tensor in gathered.items():
            params[name].copy_(tensor)
    differing = sorted(name for name, tensor in gathered.items() if not torch.equal(params[name].detach().cpu(), tensor))
    if differing:
        raise ValueError(f"adapter at {url} did not restore exactly: {differing}")


def load_adapter(checkpoint: CheckpointRef, model: Any, *, storage_options: dict[str, Any] | None = None) -> Any:
    """Restore the student's LoRA adapter weights in place, exactly; return the saved processor.

    Each adapter's ``adapter_model.safetensors`` (PEFT's layout) is parsed without pickle, set with
    ``set_peft_model_state_dict`` onto the parameters' device, read back and compared bit for bit:
    keys, shapes and dtypes must match (a partial restore would train another adapter). The processor
    is rebuilt with the manifest's ``transformers`` class, else ``AutoProcessor`` / ``AutoTokenizer``,
    ``trust_remote_code=False``.

    Args:
        checkpoint (str | os.PathLike | tuple[ReadableStore, int]): step prefix or ``(store, step)``.
        model (Any): a PEFT model whose adapters were created with the saved configuration.
        storage_options (dict | None): fsspec options for a URL.

    Returns:
        Any | None: the saved processor, or ``None`` when none was saved.

    Rank obligations: every rank that holds a replica of the student calls this.

    Raises:
        IncompleteCheckpointError: (a ``ValueError``) the checkpoint is not complete.
        ValueError: missing or unexpected adapter keys (named), mismatched shapes or dtypes, an
            inexact restore, or a processor that cannot be loaded.
        TypeError: ``model`` is not a PEFT model.
        CheckpointNotFoundError: (a ``FileNotFoundError``) no adapter weights for one of its adapters.
        IntegrityError: a payload's bytes differ from its manifest entry.
    """
    store, step, report = open_checkpoint(checkpoint, storage_options)
    url = report.url
    names = store.names(step)
    if DCP_METADATA in names:
        _restore_from_shards(store.store, step, model, url)  # a sharded step is never legacy
    else:
        _restore_peft_adapter(store, step, names, model, url)
    class_name = None
    if report.status == COMPLETE:
        class_name = store.manifest(step).metadata.get("processor_class")
    return _load_processor(store, step, names, url, class_name)


__all__ = ["load_adapter"]
