"""Elastic resume: what every rank restores when the world size changed (``resume_mode: elastic``).

Model and optimizer load at any size (DCP reshards); rank ``r < saved_world_size`` gets its own
RNG back, a new rank one derived from the checkpoint alone (:func:`elastic_seed`); states of ranks
no longer present are reported and kept. The policy and what it does not reproduce:
docs/resume.md, "Elastic resume".
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

from ._rng import derived_rng_state

logger = logging.getLogger("opd_store.opd")

_SEED_DOMAIN = "opd_store elastic rng v1"


def elastic_seed(*, step: int, config_fingerprint: str, rank: int) -> int:
    """The seed of a new rank's RNG state: the first 63 bits of
    ``SHA-256("opd_store elastic rng v1|step=<step>|config=<fingerprint>|rank=<rank>")``."""
    text = f"{_SEED_DOMAIN}|step={int(step)}|config={config_fingerprint}|rank={int(rank)}"
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 1


@dataclasses.dataclass(frozen=True)
class ElasticResume:
    """One rank's side of a resume, elastic or not.

    Attributes:
        saved_world_size (int): ranks that wrote the checkpoint.
        world_size (int): ranks of this run.
        rank (int): this rank.
        step (int): the checkpoint's step.
        config_fingerprint (str): the checkpoint's config fingerprint (part of the derivation).
    """

    saved_world_size: int
    world_size: int
    rank: int
    step: int
    config_fingerprint: str

    @property
    def changed(self) -> bool:
        """True when the world size differs from the saved one."""
        return self.saved_world_size != self.world_size

    @property
    def restores_own_rng(self) -> bool:
        """True when this rank has a saved RNG state (``rank < saved_world_size``)."""
        return self.rank < self.saved_world_size

    @property
    def rng_source(self) -> str:
        """``"restored"`` or ``"derived"``."""
        return "restored" if self.restores_own_rng else "derived"

    @property
    def unclaimed_ranks(self) -> tuple[int, ...]:
        """Saved ranks whose per-rank states no rank of this run restores."""
        return tuple(range(self.world_size, self.saved_world_size))

    def derived_rng(self) -> dict[str, Any]:
        """This rank's derived RNG state (``opd_rng_v1``), the same on every machine."""
        return derived_rng_state(elastic_seed(step=self.step, config_fingerprint=self.config_fingerprint,
                                              rank=self.rank))

    def describe(self) -> str:
        """One line for logs and events."""
        text = (f"world size {self.saved_world_size} -> {self.world_size}: rank {self.rank} RNG {self.rng_source}")
        if self.unclaimed_ranks:
            text += f"; saved per-rank states of ranks {list(self.unclaimed_ranks)} are not restored"
        return text

    def report(self) -> None:
        """Log the change once (rank 0), naming the unclaimed per-rank states."""
        if self.changed and self.rank == 0:
            logger.warning("elastic resume of step %d: %s", self.step, self.describe())


__all__ = ["ElasticResume", "elastic_seed"]
