"""Lazy exports (PEP 562): a package names public objects whose modules import heavy dependencies
(torch, transformers) and imports each module on first access, so ``import opd_store`` and the
store-only commands stay light."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps a public name to the module
    (absolute, or relative to ``package``) that defines it.

    Raises:
        AttributeError: (from the returned function) a name ``exports`` does not hold.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__all__ = ["lazy_exports"]
