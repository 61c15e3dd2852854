"""On-policy-distillation checkpoints on the store: the seed's save and resume contract, rebuilt
on manifests (docs/resume.md).

For users: saving (:func:`save_opd_checkpoint`, :class:`AsyncCheckpointer`,
:func:`save_sharded_opd_checkpoint`), loading (:func:`load_opd_checkpoint`, :func:`load_adapter`,
:func:`load_sharded_opd_checkpoint`, :func:`latest_complete_checkpoint`), the config whose fields
decide a resume (:class:`OPDConfig`, :data:`RESUME_MODES`), data-loader positions for a mid-epoch
resume (:class:`LoaderPosition`, :class:`GlobalSamplePosition`), the import of legacy checkpoints
(:func:`migrate_legacy`) and :func:`preserve_global_rng`. For the layers above (the job, the
integrations): the process-group helpers of :mod:`._distributed` and :func:`validate_resume`.
Every module imports torch, so each name is imported on first use.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._adapter import load_adapter
    from ._async_save import AsyncCheckpointer, SaveHandle
    from ._config import OPDConfig
    from ._data import GlobalSamplePosition, LoaderPosition
    from ._distributed import agree_on_notice, agreement_group, current_group, decide_on_rank0, load_collective
    from ._legacy import MigrationResult, migrate_legacy
    from ._load import latest_complete_checkpoint, load_opd_checkpoint
    from ._names import SCHEMA_SHARDED, payload_rank
    from ._resume import RESUME_MODES, validate_resume
    from ._rng import preserve_global_rng
    from ._save import save_opd_checkpoint
    from ._sharded import save_sharded_opd_checkpoint
    from ._sharded_load import load_sharded_opd_checkpoint

_EXPORTS = {
    "load_adapter": "._adapter",
    "AsyncCheckpointer": "._async_save",
    "SaveHandle": "._async_save",
    "OPDConfig": "._config",
    "GlobalSamplePosition": "._data",
    "LoaderPosition": "._data",
    "agree_on_notice": "._distributed",
    "agreement_group": "._distributed",
    "current_group": "._distributed",
    "decide_on_rank0": "._distributed",
    "load_collective": "._distributed",
    "MigrationResult": "._legacy",
    "migrate_legacy": "._legacy",
    "latest_complete_checkpoint": "._load",
    "load_opd_checkpoint": "._load",
    "SCHEMA_SHARDED": "._names",
    "payload_rank": "._names",
    "RESUME_MODES": "._resume",
    "validate_resume": "._resume",
    "preserve_global_rng": "._rng",
    "save_opd_checkpoint": "._save",
    "save_sharded_opd_checkpoint": "._sharded",
    "load_sharded_opd_checkpoint": "._sharded_load",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
