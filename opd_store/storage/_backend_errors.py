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
S3           ``PreconditionFailed`` (412): s3fs                         LOST_RACE    S3 "Conditional
             ``FileExistsError`` when the reply names                                writes": a
             its ``<Condition>`` (AWS, moto), else a                                 ``PutObject`` with
             plain ``OSError`` (SeaweedFS)                                           ``If-None-Match:
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
S3           botocore ``NoCredentialsError``, ``PartialCredentials     NO_CREDEN-   botocore's
             Error``, ``CredentialRetrievalError``, ``ProfileNotFound`` TIALS        credential chain
             (a ``profile`` option or ``AWS_PROFILE`` naming no
             profile of ``~/.aws/config``)
GCS          google-auth ``DefaultCredentialsError``                    NO_CREDEN-   google-auth
                                                                        TIALS        ``default()``
any          a connection refused, a name that does not resolve, a      UNREACHABLE  botocore,
             timeout (botocore ``EndpointConnectionError``,                          aiohttp,
             ``Connect/ReadTimeoutError``, aiohttp ``ClientConnector                 requests,
             Error``, ``ServerTimeoutError``, requests ``Connection                  google-auth
             Error``/``Timeout``, google-auth ``TransportError``,                    exception
             builtin ``ConnectionError``/``TimeoutError``/``gaierror``)              hierarchies
===========  ======================================================  ===========  =================

Anything else is :attr:`Meaning.OTHER`: for a write, an outcome that is unknown until read back
(so is a timeout: the request may have landed). :func:`explain` turns a failure into the cause a
person reads (``endpoint http://HOST:PORT did not answer within 60 s``, ``no credentials found
(...)``); every message that reports a backend failure takes its cause from there.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit


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
    NO_CREDENTIALS = "no_credentials"
    """The client found no credentials to sign requests with (nothing was sent)."""
    UNREACHABLE = "unreachable"
    """No answer from the endpoint: connection refused, a host name that does not resolve, a
    connect or read timeout. A write's outcome is unknown until read back."""
    OTHER = "other"
    """Anything else (a server error): a write's outcome is unknown until read back."""


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

# Exception class names (anywhere in an exception's MRO) of the clients' credential and connection
# failures: matched by name so this module imports none of botocore, aiohttp, requests or google-auth.
_NO_CREDENTIALS_NAMES = frozenset({
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "DefaultCredentialsError",
    "ProfileNotFound",
})
_UNREACHABLE_NAMES = frozenset({
    "ConnectionError",  # builtin (refused, reset) and requests' own
    "TimeoutError",  # builtin, asyncio's and fsspec's FSTimeoutError
    "gaierror",  # socket: the host name does not resolve
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ProxyConnectionError",  # botocore
    "ClientConnectorError", "ClientConnectionError", "ServerTimeoutError", "SocketTimeoutError",  # aiohttp
    "Timeout",  # requests
    "TransportError",  # google-auth: the token or metadata endpoint did not answer
})
_TIMEOUT_NAMES = frozenset({"TimeoutError", "ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError",
                            "SocketTimeoutError", "Timeout", "ConnectTimeout", "ReadTimeout"})
_CLOSED_NAMES = frozenset({"ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "ConnectionClosedError",
                           "ServerDisconnectedError", "RemoteDisconnected"})
_CONNECT_TIMEOUT_NAMES = frozenset({"ConnectTimeoutError", "ConnectTimeout", "ConnectionTimeoutError"})

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


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _gcs_status(exc: BaseException) -> int | None:
    for error in _chain(exc):
        if type(error).__name__ == "HttpError" and isinstance(getattr(error, "code", None), int):
            return error.code
    return None


def classify(exc: BaseException) -> Meaning:
    """The :class:`Meaning` of a failure raised by a backend (or by a storage verb).

    The most specific signal wins: an S3 error code anywhere in the chain, then a GCS HTTP status,
    then the builtin type s3fs/gcsfs/the OS raised, then a credential or connection failure
    anywhere in the chain, then gcsfs's ``Forbidden`` text.

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
    for error in _chain(exc):
        names = _names(error)
        if names & _NO_CREDENTIALS_NAMES:
            return Meaning.NO_CREDENTIALS
        if names & _UNREACHABLE_NAMES:
            return Meaning.UNREACHABLE
    if isinstance(exc, OSError) and str(exc).startswith("Forbidden"):
        return Meaning.DENIED  # gcsfs: validate_response raises OSError(f"Forbidden: {path}...") for 403
    return Meaning.OTHER


def is_rate_limited(exc: BaseException) -> bool:
    """True when ``exc`` says the store refused the request for its rate: an S3 throttling code
    (``SlowDown``, ``Throttling``...) or GCS's ``429``. A GCS ``503`` is :attr:`Meaning.THROTTLED` too
    (retry it later) but a backend error, not a request rate (GCS docs, "HTTP status and error
    codes"): the pacing of uploads (:mod:`opd_store.storage.transfers._pacing`) answers only rates."""
    code = s3_error_code(exc)
    if code is not None:
        return _S3_CODES.get(code) is Meaning.THROTTLED
    return _gcs_status(exc) == 429


def s3_answer_meaning(code: str | None, status: int | None) -> Meaning:
    """The :class:`Meaning` of one S3 answer seen before botocore decides to retry it (its error
    ``code`` and HTTP ``status``): a throttling code, or ``503`` without a body (a ``HEAD``), is
    :attr:`Meaning.THROTTLED` (S3: "503 Slow Down")."""
    if code in _S3_CODES:
        return _S3_CODES[code]
    return Meaning.THROTTLED if status == 503 and not code else Meaning.OTHER


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
    """One line naming a failure: ``"<Type>: <first line of the message>"`` (and the second when
    the first ends with ``:``), with the meaning and
    backend code when the table knows them (``"(denied, AccessDenied)"``)."""
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    meaning = classify(exc)
    if meaning is Meaning.OTHER:
        return text
    code = s3_error_code(exc)
    return f"{text} ({meaning.value}{', ' + code if code else ''})"


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` means the store could not be reached at all (no credentials, no answer)."""
    return classify(exc) in (Meaning.NO_CREDENTIALS, Meaning.UNREACHABLE)


_CLIENT_PACKAGES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "requests", "urllib3", "fsspec")


def is_backend_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or a cause) was raised by a backend client library rather than by a bug:
    a meaning the table knows, or an exception class of botocore, s3fs, gcsfs, google-auth,
    aiohttp, requests or fsspec (a GCS ``HttpError`` 500 after gcsfs's retries, a botocore error
    the table has no row for)."""
    if classify(exc) is not Meaning.OTHER:
        return True
    return any(type(error).__module__.split(".")[0] in _CLIENT_PACKAGES for error in _chain(exc, implicit=True))


def endpoint_of(exc: BaseException) -> str | None:
    """``scheme://host:port`` of the endpoint a connection failure names, if it names one
    (botocore's ``endpoint_url``, aiohttp's connection key, requests' request URL)."""
    for error in _chain(exc, implicit=True):
        url = (getattr(error, "kwargs", None) or {}).get("endpoint_url") if isinstance(
            getattr(error, "kwargs", None), dict) else None
        request = getattr(error, "request", None)
        url = url or getattr(request, "url", None)
        if isinstance(url, str) and "://" in url:
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}"
        host, port = getattr(error, "host", None), getattr(error, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return f"{host}:{port}"
    return None


def explain(
    exc: BaseException,
    *,
    endpoint: str | None = None,
    connect_timeout_secs: float | None = None,
    read_timeout_secs: float | None = None,
    credential_sources: str | None = None,
) -> str:
    """The cause of a backend failure in words, for a one-line message (no type names, no stack).

    Args:
        exc (BaseException): the failure (its whole chain is read).
        endpoint (str | None): the endpoint the store talks to, named when the failure does not
            name one itself.
        connect_timeout_secs (float | None): the connect timeout in force, named for a connect
            timeout.
        read_timeout_secs (float | None): the read timeout in force, named for a read timeout.
        credential_sources (str | None): where the client looks for credentials, named when it
            found none (``GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server``).

    Returns:
        str: e.g. ``endpoint http://127.0.0.1:9000 did not answer within 60 s``,
        ``endpoint http://127.0.0.1:9000 refused the connection``, ``no credentials found (...)``,
        ``access denied (AccessDenied)``, or :func:`describe` for anything else.
    """
    meaning = classify(exc)
    if meaning is Meaning.NO_CREDENTIALS:
        missing_profile = next((error for error in _chain(exc) if "ProfileNotFound" in _names(error)), None)
        if missing_profile is not None:  # botocore: "The config profile (NAME) could not be found"
            return f"no credentials: {_first_line(missing_profile)}"
        return f"no credentials found ({credential_sources})" if credential_sources else "no credentials found"
    if meaning is Meaning.DENIED:
        code = s3_error_code(exc) or _gcs_status(exc)
        return f"access denied ({code or _first_line(exc)})"
    if meaning is not Meaning.UNREACHABLE:
        return describe(exc)
    where = f"endpoint {endpoint_of(exc) or endpoint or 'of the store'}"
    chain = list(_chain(exc, implicit=True))
    names = set().union(*(_names(error) for error in chain))
    # Refused and unresolvable first: urllib3's NewConnectionError subclasses its ConnectTimeoutError.
    if any(isinstance(error, ConnectionRefusedError) for error in chain):
        return f"{where} refused the connection"
    resolve = next((error for error in chain if isinstance(error, socket.gaierror)), None)
    if resolve is not None:
        return f"{where}: its host name does not resolve ({resolve.strerror or resolve})"
    if names & _CONNECT_TIMEOUT_NAMES:
        within = f" within {connect_timeout_secs:g} s" if connect_timeout_secs else ""
        return f"{where} did not accept a connection{within}"
    if names & _TIMEOUT_NAMES:
        within = f" within {read_timeout_secs:g} s" if read_timeout_secs else ""
        return f"{where} did not answer{within}"
    if names & _CLOSED_NAMES:
        return f"{where} closed the connection ({_first_line(exc)})"
    return f"cannot connect to {where} ({_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    """The message's first line; when it only introduces what follows (ends with ``:``, as
    botocore's ``Parameter validation failed:`` does), the next line too, so the cause is never cut off."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


__all__ = [
    "Meaning",
    "backend_operation",
    "classify",
    "describe",
    "endpoint_of",
    "explain",
    "is_backend_failure",
    "is_missing",
    "is_rate_limited",
    "is_unreachable",
    "s3_answer_meaning",
    "s3_error_code",
]
