"""Which tier of a tiered store answers a read, and whether the bucket already holds a step.

A step complete in both tiers with the same payload entries is read from local disk (no payload
request to the bucket); when the entries differ, the bucket's copy wins (it is the durable one)
and a warning is logged; a bucket that cannot be asked does not make a complete local copy
unreadable (every read of it is checked: size, CRC32C).
"""

from __future__ import annotations

import logging
import threading

from ..errors import ManifestError
from ..format import Manifest
from ..store import COMPLETE, CheckpointInfo, CheckpointStore

logger = logging.getLogger("opd_store.tiered")


def same_payloads(a: Manifest, b: Manifest) -> bool:
    """True when two manifests name the same payloads with the same sizes and CRC32Cs.

    Attempt ids (hence paths), writers and commit times may differ: a bucket copy made by
    :func:`~opd_store.store._copy.copy_checkpoint` matches its local original.
    """
    def key(manifest: Manifest) -> set[tuple[str, int, str]]:
        return {(entry.name, entry.size_bytes, entry.crc32c) for entry in manifest.payloads}

    return a.step == b.step and key(a) == key(b)


def pick_tier(local: CheckpointStore, bucket: CheckpointStore, step: int) -> CheckpointStore:
    """The tier reads of ``step`` go to: the local tier when its copy is complete and the bucket has no
    manifest for it or the same payload entries; else the bucket (the durable one; a warning names
    both URLs when copies differ); the local tier again when the bucket's differing copy is incomplete
    or the bucket cannot be asked (logged). Costs one bucket manifest read, never a payload read.
    """
    local_state = local.step_state(step)
    if local_state.status != COMPLETE:
        return bucket
    try:
        bucket_manifest = bucket.find_manifest(step)
    except ManifestError:
        return local
    except OSError as exc:
        # The local copy is complete and every read of it is checked (size, CRC32C): a
        # bucket that cannot be asked right now does not make it unreadable.
        logger.warning("could not read the manifest of step %d in %s (%r); reading the local copy",
                       step, bucket.url, exc)
        return local
    if bucket_manifest is None:
        return local
    if local_state.manifest is not None and same_payloads(local_state.manifest, bucket_manifest):
        return local
    if bucket.is_complete(step):
        logger.warning(
            "step %d differs between the local tier (%s) and the bucket (%s); reading the bucket's copy",
            step, local.step_url(step), bucket.step_url(step),
        )
        return bucket
    return local


def merge_checkpoints(local_infos: list[CheckpointInfo], bucket_infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Every step of either tier with its status, as the tier :func:`pick_tier` would pick
    reports it (a complete copy wins over an incomplete one)."""
    local = {info.step: info for info in local_infos}
    bucket = {info.step: info for info in bucket_infos}
    merged = []
    for step in sorted(set(local) | set(bucket)):
        a, b = local.get(step), bucket.get(step)
        if a is not None and a.status == COMPLETE and (
            b is None or b.status != COMPLETE or (a.manifest and b.manifest and same_payloads(a.manifest, b.manifest))
        ):
            merged.append(a)
        elif b is not None and (b.status == COMPLETE or a is None or a.status != COMPLETE):
            merged.append(b)
        else:
            merged.append(a)
    return merged


class BucketCheck:
    """Asks, in a thread of its own, whether the bucket holds ``step``; :meth:`in_bucket` waits for
    the answer. A bucket that cannot be asked answers ``False`` with a warning: the local tier
    exists so that saves do not depend on the bucket being reachable right now, and the upload's
    create-only commit still refuses a conflict."""

    def __init__(self, bucket: CheckpointStore, step: int) -> None:
        self._bucket = bucket
        self._step = step
        self._answer = False
        self._thread = threading.Thread(target=self._run, name=f"opd-store-check-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # One delimiter listing of the step prefix: a small save (a LoRA adapter) finishes its
            # local write before the bucket answers, so this latency is what a tiered save adds to
            # a plain one (docs/performance.md, "Local tier").
            self._answer = self._bucket.holds_step(self._step)
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            logger.warning("could not check %s for step %d before saving: %r", self._bucket.url, self._step, exc)

    def in_bucket(self) -> bool:
        self._thread.join()
        return self._answer


__all__ = ["BucketCheck", "merge_checkpoints", "pick_tier", "same_payloads"]
