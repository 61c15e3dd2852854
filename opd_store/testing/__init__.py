"""Testing support for users of opd_store (docs/testing.md#testing-your-own-storage):
:class:`StorageConformance` checks every verb of a ``Storage`` through the backend's own client
(subclass it, define the ``storage`` and ``raw`` fixtures; it needs pytest, imported on first
use); :class:`FaultyStorage` wraps a storage, records every call and fails those a :class:`Fault`
selects.
"""

from typing import TYPE_CHECKING, Any

from ._faults import MUTATING, Fault, FaultyStorage, FaultyWriter, InjectedFault, Op

if TYPE_CHECKING:
    from ._conformance import RawBackend, StorageConformance

_SUITE = ("RawBackend", "StorageConformance")


def __getattr__(name: str) -> Any:
    """The suite's names, imported on first use (PEP 562): they need pytest.

    Raises:
        ImportError: pytest is not installed.
        AttributeError: any other name.
    """
    if name not in _SUITE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import pytest
    except ImportError as exc:
        raise ImportError(f"opd_store.testing.{name}: the conformance suite runs under pytest (pip install pytest)") from exc
    # Before the import: pytest then rewrites the suite's asserts, so a failing check shows its values.
    pytest.register_assert_rewrite(f"{__name__}._conformance")
    from . import _conformance

    for export in _SUITE:
        globals()[export] = getattr(_conformance, export)
    return globals()[name]


__all__ = ["MUTATING", "Fault", "FaultyStorage", "FaultyWriter", "InjectedFault", "Op", "RawBackend",
           "StorageConformance"]
