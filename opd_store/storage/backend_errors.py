"""The one table of backend failures: what each backend's client raises, and what it means here.

Code above the storage seam never inspects a botocore, gcsfs or OS error itself: it asks
:func:`classify` for the failure's :class:`Meaning` and acts on that (the manifest commit settles a
lost race, a pin that already exists is no error, a refused payload upload is reported as a
permission error naming the operation, an unreachable store names its cause). s3fs keeps a table
of the same kind (``s3fs/errors.py``); it maps S3 codes to builtins but leaves a 409 conditional
conflict, an unconditioned 412 and throttling as plain ``OSError`` and gcsfs reports a 403 as a
plain ``OSError("Forbidden: ...")``, so the codes are looked up again here, on the whole
exception chain (s3fs and gcsfs keep the client error as ``__cause__``).

===========  ======================================================  ===========  =================
backend      what the client raises                                   meaning      source
===========  ======================================================  ===========  =================
S3           ``PreconditionFailed`` (412), s3fs ``FileExistsError``    LOST_RACE    S3 "Conditional
                                                                                   writes": a
                                                                                   ``PutObject`` with
                                                                                   ``If-None-Match:
                                                                                   *`` on an existing
                                                                                   key is refused 412
S3           ``ConditionalRequestConflict`` (409)                       LOST_RACE    same page: a
                                                                                   concurrent
                                                                                   conditional write
                                                                                   of the key is
                                                                                   refused 409
S3           ``NoSuchKey``, ``NoSuchBucket``, ``NoSuchUpload`` (404)    NOT_FOUND    S3 error codes
S3           ``AccessDenied`` (403), invalid/unsigned credentials       DENIED       S3 error codes
S3           ``SlowDown`` (503), ``Throttling``, ``TooManyRequests``    THROTTLED    S3 "Best practices
                                                                                   design patterns":
                                                                                   503 Slow Down
GCS          ``FileExistsError`` (gcsfs for 412), ``HttpError`` 412     LOST_RACE    GCS "Request
                                                                                   preconditions":
                                                                                   ``ifGenerationMatch
                                                                                   =0`` fails 412
GCS          ``FileNotFoundError`` (404)                                NOT_FOUND    GCS status codes
GCS          ``OSError("Forbidden: ...")`` (gcsfs for 403), 401         DENIED       GCS status codes
GCS          ``HttpError`` 429 or 503                                   THROTTLED    GCS "Retry
                                                                                   strategy"
local        ``FileExistsError`` (``link(2)``: EEXIST)                  LOST_RACE    link(2)
memory       ``FileExistsError`` (exists check under the lock)          LOST_RACE    this package
local        ``FileNotFoundError`` / ``PermissionError``                NOT_FOUND /  open(2)
                                                                        DENIED
===========  ======================================================  ===========  =================

Anything else is :attr:`Meaning.OTHER`: for a write, an outcome that is unknown until read back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator


class Meaning(str, enum.Enum):
    """What a backend failure means to opd_store."""

    LOST_RACE = "lost_race"
    """A create-only write was refused because the object exists (or another conditional write of
    it is in flight): another writer won, or is winning; read the object back to know which."""
    NOT_FOUND = "not_found"
    """No such object, prefix or bucket."""
    DENIED = "denied"
    """The backend refused the request for lack of permission (credentials, bucket policy)."""
    THROTTLED = "throttled"
    """The backend asked the client to slow down; the request may be retried later."""
    OTHER = "other"
    """Anything else (network, server error): a write's outcome is unknown until read back."""


# S3 error codes (botocore ``ClientError.response["Error"]["Code"]``).
_S3_CODES: dict[str, Meaning] = {
    "PreconditionFailed": Meaning.LOST_RACE,
    "ConditionalRequestConflict": Meaning.LOST_RACE,
    "NoSuchKey": Meaning.NOT_FOUND,
    "NoSuchBucket": Meaning.NOT_FOUND,
    "NoSuchUpload": Meaning.NOT_FOUND,
    "AccessDenied": Meaning.DENIED,
    "AllAccessDisabled": Meaning.DENIED,
    "InvalidAccessKeyId": Meaning.DENIED,
    "SignatureDoesNotMatch": Meaning.DENIED,
    "ExpiredToken": Meaning.DENIED,
    "SlowDown": Meaning.THROTTLED,
    "Throttling": Meaning.THROTTLED,
    "ThrottlingException": Meaning.THROTTLED,
    "RequestLimitExceeded": Meaning.THROTTLED,
    "TooManyRequests": Meaning.THROTTLED,
    "RequestThrottled": Meaning.THROTTLED,
}

# HTTP statuses of GCS JSON API errors (gcsfs ``HttpError.code``).
_GCS_STATUSES: dict[int, Meaning] = {
    412: Meaning.LOST_RACE,
    404: Meaning.NOT_FOUND,
    401: Meaning.DENIED,
    403: Meaning.DENIED,
    429: Meaning.THROTTLED,
    503: Meaning.THROTTLED,
}

# Builtins raised by s3fs, gcsfs and the local filesystem after their own translation.
_BUILTINS: tuple[tuple[type[BaseException], Meaning], ...] = (
    (FileExistsError, Meaning.LOST_RACE),
    (FileNotFoundError, Meaning.NOT_FOUND),
    (PermissionError, Meaning.DENIED),
)


def _chain(exc: BaseException, *, implicit: bool = False) -> Iterator[BaseException]:
    """``exc`` and each exception it was raised ``from`` (s3fs and gcsfs chain the client error as
    ``__cause__``), each once; with ``implicit`` also those it was raised while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (current.__context__ if implicit else None)


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code (``PreconditionFailed``, ``SlowDown``...) of a botocore ``ClientError``
    in ``exc``'s chain, or ``None``."""
    for error in _chain(exc):
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if isinstance(code, str) and code:
                return code
    return None


def _gcs_status(exc: BaseException) -> int | None:
    for error in _chain(exc):
        if type(error).__name__ == "HttpError" and isinstance(getattr(error, "code", None), int):
            return error.code
    return None


def classify(exc: BaseException) -> Meaning:
    """The :class:`Meaning` of a failure raised by a backend (or by a storage verb).

    The most specific signal wins: an S3 error code anywhere in the chain, then a GCS HTTP status,
    then the builtin type s3fs/gcsfs/the OS raised, then gcsfs's ``Forbidden`` text.

    Args:
        exc (BaseException): the exception caught around a backend call.

    Returns:
        Meaning: what it means; :attr:`Meaning.OTHER` when nothing in the table matches.
    """
    code = s3_error_code(exc)
    if code in _S3_CODES:
        return _S3_CODES[code]
    status = _gcs_status(exc)
    if status in _GCS_STATUSES:
        return _GCS_STATUSES[status]
    for builtin, meaning in _BUILTINS:
        if isinstance(exc, builtin):
            return meaning
    if isinstance(exc, OSError) and str(exc).startswith("Forbidden"):
        return Meaning.DENIED  # gcsfs: validate_response raises OSError(f"Forbidden: {path}...") for 403
    return Meaning.OTHER


def is_missing(exc: BaseException) -> bool:
    """True when ``exc`` says the object, prefix or bucket does not exist."""
    return classify(exc) is Meaning.NOT_FOUND


def backend_operation(exc: BaseException) -> str | None:
    """The name of the backend API operation behind ``exc`` or one of its causes, if it has one.

    botocore's ``ClientError`` carries ``operation_name`` (``CreateMultipartUpload``,
    ``UploadPart``, ``PutObject``); s3fs re-raises it as a builtin with the ``ClientError`` as
    ``__cause__``.
    """
    for error in _chain(exc, implicit=True):
        name = getattr(error, "operation_name", None)
        if isinstance(name, str) and name:
            return name
    return None


def describe(exc: BaseException) -> str:
    """One line naming a failure: ``"<Type>: <first line of the message>"``, with the meaning and
    backend code when the table knows them (``"(denied, AccessDenied)"``)."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    meaning = classify(exc)
    if meaning is Meaning.OTHER:
        return text
    code = s3_error_code(exc)
    return f"{text} ({meaning.value}{', ' + code if code else ''})"


__all__ = ["Meaning", "backend_operation", "classify", "describe", "is_missing", "s3_error_code"]
