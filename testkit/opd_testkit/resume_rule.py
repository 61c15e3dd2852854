"""The outcome every row of the damaged-checkpoint tables asserts, stated once in the product
(docs/resume.md, "A damaged checkpoint"; ``opd_store/store/_resume_guard.py``): a resume either
goes on from the newest intact step with a warning naming what was skipped, or stops before
training with one line naming the step, the file and the remedy.
"""

from __future__ import annotations

from pathlib import Path


def assert_stop_line(message: str, *, store_url: str, step: int, file: str) -> None:
    """``message`` is one line naming ``step``, the damaged ``file`` (its last path component) and
    the remedy, ``opd-store delete STORE_URL STEP``."""
    assert "\n" not in message.strip(), message
    assert f"step {step}" in message, message
    assert file.rsplit("/", 1)[-1] in message, message
    assert f"`opd-store delete {store_url} {step}`" in message, message


def files_under(root: str | Path) -> dict[str, bytes]:
    """Every file under a local ``root`` with its bytes (relative path -> bytes): what a stop must
    leave unchanged."""
    root = Path(root)
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


__all__ = ["assert_stop_line", "files_under"]
