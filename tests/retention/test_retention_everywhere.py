"""Every way to ask for retention works on every kind of store, and a pass that cannot run is the
caller's error at the next sync point."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from opd_store import CheckpointStore, TieredStore, save_opd_checkpoint
from opd_store.retention import RetentionPolicy

_spec = importlib.util.spec_from_file_location("opd_test_helpers", Path(__file__).parents[1] / "opd" / "conftest.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

KEEP_ONE = RetentionPolicy(keep_last=1)


def _save(store, step: int, **kwargs) -> str:
    return save_opd_checkpoint(**helpers.save_kwargs(store, successful=step, **kwargs))


# -- the bug that started it, as a user met it ------------------------------------------------------


@pytest.mark.xfail(strict=True, reason="retention on a TieredStore reaches store.storage, which it refuses")
def test_a_tiered_store_with_save_retention_keeps_one_bucket_step(s3_backend, tmp_path):
    store = TieredStore(tmp_path / "local", s3_backend.url, storage_options=s3_backend.storage_options)
    for step in (1, 2, 3, 4):
        _save(store, step, retention=KEEP_ONE)
    store.flush()
    assert CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options).steps() == [4]
    store.close()
