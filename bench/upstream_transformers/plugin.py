"""A pytest plugin that runs transformers' own checkpoint tests with their checkpoint I/O routed
through :class:`~opd_store.integrations.transformers.StoreCallback` (``python -m
bench.upstream_transformers``; docs/integrations.md, "transformers' own checkpoint tests").

The test files are run unmodified; only ``Trainer.train`` is wrapped:

* every ``train()`` gets a ``StoreCallback`` on a ``memory://`` store of its output directory, so
  every ``checkpoint-N`` the Trainer writes is committed (size and CRC32C of every file) before
  the test looks at it; after ``train()`` every committed ``checkpoint-N`` still on disk must equal
  the store's copy byte for byte (else the test fails with the difference);
* a resume (``resume_from_checkpoint=<dir>/checkpoint-N``, or ``True``) reads the store: the
  directory is replaced by ``store_checkpoint``'s verified copy of step ``N`` (``True``: the
  newest complete step) before the Trainer loads it;
* a run that starts below the newest step of its store (a resume of an older checkpoint, a second
  run in the same output directory) commits into a store of its own holding a copy of the step it
  resumed (the remedy opd_store's refusal names: "give the run a new store URL"), so the callback
  still checks the resumed step's run config (``exact``) and records the lineage.

``OPD_UPSTREAM_ASYNC=1`` gives the callbacks ``async_upload=True``. At the end of the session the
plugin prints how many checkpoints were committed, fetched and compared.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

COUNTS = {"committed": 0, "fetched": 0, "compared": 0, "own_store": 0}
_RUNS = itertools.count(1)
_ORIGINAL_TRAIN = None


def _store_url(output_dir: str) -> str:
    """The store of an output directory (one per absolute path, for the whole session)."""
    return f"memory://opd-upstream/{hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:16]}"


def _step_of(path) -> tuple[str, int] | None:
    """``(parent directory, N)`` of a ``<parent>/checkpoint-N`` path, else ``None``."""
    from opd_store.integrations._hf_layout import step_of_dirname

    step = step_of_dirname(os.fspath(path))
    return (os.path.dirname(os.path.abspath(os.fspath(path))), step) if step is not None else None


def _complete_steps(url: str) -> list[int]:
    from opd_store.store import COMPLETE, as_store

    return [info.step for info in as_store(url).checkpoints() if info.status == COMPLETE]


def _resume_from_store(resume):
    """``resume`` with its checkpoint fetched from the store: ``(argument for train, store URL, step)``;
    the URL and step are ``None`` when the resume does not name a step a store holds."""
    from opd_store.integrations.transformers import store_checkpoint

    named = None if isinstance(resume, bool) or resume is None else _step_of(resume)
    if named is None:
        return resume, None, None
    parent, step = named
    url = _store_url(parent)
    if step not in _complete_steps(url):
        return resume, None, None
    path = store_checkpoint(url, parent, step=step)
    COUNTS["fetched"] += 1
    return path, url, step


def _run_store(output_dir: str, resumed_url: str | None, step: int | None) -> str:
    """The store this ``train()`` commits into (module docs)."""
    from opd_store.store import as_store, copy_checkpoint

    own = _store_url(output_dir)
    steps = _complete_steps(own)
    if step is None and not steps:
        return own
    if step is not None and resumed_url == own and steps and steps[-1] == step:
        return own
    url = f"{own}-run{next(_RUNS)}"
    if step is not None:
        copy_checkpoint(as_store(resumed_url), step, as_store(url), verify_deep=False)
    COUNTS["own_store"] += 1
    return url


def _compare(output_dir: str, url: str, steps: list[int]) -> None:
    """Every committed ``checkpoint-N`` still on disk equals the store's copy.

    Raises:
        AssertionError: a file differs, or a name is in one and not the other.
    """
    from opd_store.store import as_store

    store = as_store(url)
    for step in steps:
        local = Path(output_dir) / f"checkpoint-{step}"
        if not local.is_dir():
            continue  # rotated away by save_total_limit
        files = {p.relative_to(local).as_posix(): p for p in local.rglob("*") if p.is_file()}
        names = set(store.names(step))
        assert names == set(files), f"{local} holds {sorted(files)}, the store's step {step} {sorted(names)}"
        for name in sorted(names):
            assert store.read(step, name) == files[name].read_bytes(), f"{local}/{name} differs from the store's copy"
        COUNTS["compared"] += 1


def _train(self, resume_from_checkpoint=None, *args, **kwargs):
    from opd_store.integrations.transformers import StoreCallback

    output_dir = os.path.abspath(self.args.output_dir)
    url, step = None, None
    if resume_from_checkpoint is True:
        steps = _complete_steps(_store_url(output_dir))
        if steps:  # the newest complete step, as get_last_checkpoint picks the newest local directory
            resume_from_checkpoint = os.path.join(output_dir, f"checkpoint-{steps[-1]}")
    resume_from_checkpoint, url, step = _resume_from_store(resume_from_checkpoint)
    run_url = _run_store(output_dir, url, step)
    self.remove_callback(StoreCallback)
    callback = StoreCallback(run_url, async_upload=os.environ.get("OPD_UPSTREAM_ASYNC") == "1")
    self.add_callback(callback)
    result = _ORIGINAL_TRAIN(self, resume_from_checkpoint, *args, **kwargs)
    COUNTS["committed"] += len(callback.committed_steps)
    _compare(output_dir, run_url, callback.committed_steps)
    return result


def pytest_configure(config) -> None:
    """Wrap ``transformers.Trainer.train`` for the session (module docs)."""
    global _ORIGINAL_TRAIN
    from transformers import Trainer

    _ORIGINAL_TRAIN = Trainer.train
    Trainer.train = _train


def pytest_unconfigure(config) -> None:
    if _ORIGINAL_TRAIN is not None:
        from transformers import Trainer

        Trainer.train = _ORIGINAL_TRAIN


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(
        f"opd_store: {COUNTS['committed']} checkpoints committed, {COUNTS['fetched']} resumes fetched from the store, "
        f"{COUNTS['compared']} local checkpoints equal to the store's copy, {COUNTS['own_store']} runs on a store of "
        "their own")
