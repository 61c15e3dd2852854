"""Price tables for ``opd-store report``'s cost estimate: built in for S3 (S3 Standard, us-east-1,
AWS "Amazon S3 pricing") and GCS (Standard, us-central1, "Cloud Storage pricing"), or a file
(``--prices FILE``: :class:`PriceTable`'s fields). docs/ledger.md shows them.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import PriceTableError

GIB = 1 << 30
REQUEST_KINDS = ("list", "head", "get", "put", "post", "delete")


class PriceTable(BaseModel):
    """What a store costs.

    Attributes:
        name (str): what the table is (shown in the report).
        currency (str): the prices' currency.
        storage_per_gib_month (float): storing one GiB (2**30 bytes) for a month.
        requests_per_1000 (dict[str, float]): 1,000 requests of each kind; a kind left out is free.

    Raises:
        ValueError: an unknown request kind, a negative or a non-finite price (YAML's ``.inf`` would
            make the report's costs ``inf``, which ``--json`` cannot write as JSON).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=200)
    currency: str = Field(default="USD", min_length=1, max_length=8)
    storage_per_gib_month: float = Field(ge=0)
    requests_per_1000: dict[str, float] = Field(default_factory=dict)

    @field_validator("requests_per_1000")
    @classmethod
    def _known_kinds(cls, prices: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(prices) - set(REQUEST_KINDS))
        if unknown:
            raise ValueError(f"unknown request kind(s) {unknown}; kinds are {list(REQUEST_KINDS)}")
        negative = sorted(kind for kind, price in prices.items() if price < 0)
        if negative:
            raise ValueError(f"negative price for {negative}")
        return prices

    def request_cost(self, requests: dict[str, int]) -> float:
        """The cost of ``requests`` (by kind)."""
        return sum(self.requests_per_1000.get(kind, 0.0) * count / 1000.0 for kind, count in requests.items())

    def storage_cost_per_month(self, size_bytes: int) -> float:
        """A month of storing ``size_bytes``."""
        return self.storage_per_gib_month * size_bytes / GIB


_CLASS_A, _CLASS_B = 0.005, 0.0004  # per 1,000: S3 PUT/COPY/POST/LIST and GET/HEAD; GCS class A and B alike
BUILT_IN = {
    "s3": PriceTable(name="S3 Standard, us-east-1 (AWS list prices)", storage_per_gib_month=0.023,
                     requests_per_1000={"list": _CLASS_A, "put": _CLASS_A, "post": _CLASS_A, "get": _CLASS_B,
                                        "head": _CLASS_B, "delete": 0.0}),
    "gcs": PriceTable(name="GCS Standard, us-central1 (Google list prices)", storage_per_gib_month=0.020,
                      requests_per_1000={"list": _CLASS_A, "put": _CLASS_A, "post": _CLASS_A, "get": _CLASS_B,
                                         "head": _CLASS_B, "delete": 0.0}),
}
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def table_for_url(url: str) -> PriceTable | None:
    """The built-in table of a store URL's scheme (``s3://``: S3, ``gs://``: GCS), ``None`` for
    any other (a local or memory store costs nothing per request)."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    key = SCHEMES.get(scheme)
    return BUILT_IN[key] if key else None


def load_price_file(path: str | Path) -> PriceTable:
    """The price table in ``path`` (JSON or YAML with :class:`PriceTable`'s fields).

    Raises:
        PriceTableError: (a ``ValueError``) the file cannot be read, does not parse, or a field is
            missing, unknown or out of range; the message names the file and the field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PriceTableError(f"price file {path}: cannot read it ({exc})") from None
    try:
        raw = yaml.safe_load(text)  # YAML 1.1 reads JSON too
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise PriceTableError(f"price file {path}: does not parse as JSON or YAML{where}") from None
    if not isinstance(raw, dict):
        raise PriceTableError(f"price file {path}: expected a mapping of fields, got {type(raw).__name__}")
    try:
        return PriceTable.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(table)"
        message = first["msg"].removeprefix("Value error, ")
        raise PriceTableError(f"price file {path}: field {field}: {message}") from None


__all__ = ["BUILT_IN", "GIB", "PriceTable", "load_price_file", "table_for_url"]
