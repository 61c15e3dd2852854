"""Fixtures of the ledger tests (the stores and servers are tests/conftest.py's)."""

from __future__ import annotations

import pytest
from opd_testkit.stores import Backend


@pytest.fixture
def memory_backend() -> Backend:
    """A clean ``memory://`` location (tests/conftest.py clears the memory filesystem around each test)."""
    return Backend("memory", "memory://opd-test/runs/ledger", {})
