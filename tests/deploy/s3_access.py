"""What an S3 request needs from IAM, and whether a policy grants it.

Two small pieces used by ``test_iam_policy.py``:

- :func:`required_permissions` maps one S3 REST request (as moto's request recorder stores it:
  method, raw URL, headers, body) to the IAM actions, resource ARNs and condition keys AWS checks
  for it (AWS "Actions, resources, and condition keys for Amazon S3" and the per-operation
  "Permissions" sections of the S3 API reference). A request this table does not know raises
  ``UnknownS3Request``: a new kind of call must be added here, and to the policy, deliberately.
- :func:`is_allowed` evaluates an identity policy the way IAM does for a single principal: an
  explicit Deny wins, else any matching Allow, else denied. It supports what
  ``deploy/iam/s3-policy.json`` may use (Action/Resource wildcards ``*`` and ``?``, and the
  ``StringLike``/``StringEquals`` condition operators); anything else raises, so the policy cannot
  grow a construct this check silently ignores.
"""

from __future__ import annotations

import base64
import dataclasses
import re
import urllib.parse
import xml.etree.ElementTree as ET
from typing import Any


class UnknownS3Request(ValueError):
    """A recorded request that the IAM table below does not cover."""


@dataclasses.dataclass(frozen=True)
class Permission:
    """One authorisation check AWS makes for a request.

    Attributes:
        operation: the S3 API operation (``PutObject``, ``ListObjectsV2``, ...).
        action: the IAM action (``s3:PutObject``).
        resource: the ARN checked (``arn:aws:s3:::bucket`` or ``arn:aws:s3:::bucket/key``).
        context: condition keys AWS sets for it (``{"s3:prefix": "runs/run-1/"}`` for a listing).
    """

    operation: str
    action: str
    resource: str
    context: tuple[tuple[str, str], ...] = ()


def _split(url: str) -> tuple[str, str, dict[str, list[str]]]:
    parsed = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parsed.path)
    bucket, _, key = path.lstrip("/").partition("/")
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    return bucket, key, query


def _body(entry: dict[str, Any]) -> bytes:
    body = entry.get("body") or ""
    if entry.get("body_encoded"):
        return base64.b64decode(body)
    return body.encode() if isinstance(body, str) else bytes(body)


def _delete_objects_keys(body: bytes) -> list[str]:
    root = ET.fromstring(body)
    return [element.text or "" for element in root.iter() if element.tag.rsplit("}", 1)[-1] == "Key"]


def required_permissions(entry: dict[str, Any]) -> list[Permission]:
    """The IAM checks for one recorded S3 request (path-style URL, as s3fs sends to an endpoint).

    Args:
        entry: one line of moto's recording: ``method``, ``url``, ``headers``, ``body``, ``body_encoded``.

    Returns:
        list[Permission]: one per action/resource AWS authorises (DeleteObjects: one per key).

    Raises:
        UnknownS3Request: a request kind not in the table.
    """
    method = entry["method"].upper()
    bucket, key, query = _split(entry["url"])
    headers = {name.lower(): value for name, value in (entry.get("headers") or {}).items()}
    bucket_arn = f"arn:aws:s3:::{bucket}"
    object_arn = f"arn:aws:s3:::{bucket}/{key}"

    def first(name: str) -> str:
        return query.get(name, [""])[0]

    if not key:
        if method == "GET" and first("list-type") == "2":
            context = (("s3:prefix", first("prefix")), ("s3:delimiter", first("delimiter")))
            return [Permission("ListObjectsV2", "s3:ListBucket", bucket_arn, context)]
        if method == "GET" and "uploads" in query:
            return [Permission("ListMultipartUploads", "s3:ListBucketMultipartUploads", bucket_arn)]
        if method == "GET" and "location" in query:
            return [Permission("GetBucketLocation", "s3:GetBucketLocation", bucket_arn)]
        if method == "GET" and not query:
            context = (("s3:prefix", ""), ("s3:delimiter", ""))
            return [Permission("ListObjects", "s3:ListBucket", bucket_arn, context)]
        if method == "GET" and "prefix" in query and "list-type" not in query:
            context = (("s3:prefix", first("prefix")), ("s3:delimiter", first("delimiter")))
            return [Permission("ListObjects", "s3:ListBucket", bucket_arn, context)]
        if method == "HEAD" and not query:
            return [Permission("HeadBucket", "s3:ListBucket", bucket_arn)]
        if method == "POST" and "delete" in query:
            return [Permission("DeleteObjects", "s3:DeleteObject", f"{bucket_arn}/{name}")
                    for name in _delete_objects_keys(_body(entry))]
        raise UnknownS3Request(f"bucket-level {method} {entry['url']}")

    if method in ("GET", "HEAD") and "uploadId" in query:
        return [Permission("ListParts", "s3:ListMultipartUploadParts", object_arn)]
    if method == "GET" and not (set(query) - {"partNumber", "versionId", "response-content-type"}):
        return [Permission("GetObject", "s3:GetObject", object_arn)]
    if method == "HEAD" and not (set(query) - {"partNumber", "versionId"}):
        return [Permission("HeadObject", "s3:GetObject", object_arn)]
    if method == "PUT" and "partNumber" in query and "uploadId" in query:
        if "x-amz-copy-source" in headers:
            raise UnknownS3Request(f"UploadPartCopy {entry['url']}")
        return [Permission("UploadPart", "s3:PutObject", object_arn)]
    if method == "PUT" and not query:
        if "x-amz-copy-source" in headers:
            source = urllib.parse.unquote(headers["x-amz-copy-source"]).lstrip("/").split("?")[0]
            return [Permission("CopyObject", "s3:GetObject", f"arn:aws:s3:::{source}"),
                    Permission("CopyObject", "s3:PutObject", object_arn)]
        return [Permission("PutObject", "s3:PutObject", object_arn)]
    if method == "POST" and "uploads" in query:
        return [Permission("CreateMultipartUpload", "s3:PutObject", object_arn)]
    if method == "POST" and "uploadId" in query:
        return [Permission("CompleteMultipartUpload", "s3:PutObject", object_arn)]
    if method == "DELETE" and "uploadId" in query:
        return [Permission("AbortMultipartUpload", "s3:AbortMultipartUpload", object_arn)]
    if method == "DELETE" and not (set(query) - {"versionId"}):
        return [Permission("DeleteObject", "s3:DeleteObject", object_arn)]
    raise UnknownS3Request(f"object-level {method} {entry['url']}")


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _wildcard(pattern: str, value: str, *, ignore_case: bool = False) -> bool:
    # IAM wildcards: * any run (including '/'), ? one character; nothing else is special.
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.fullmatch(regex, value, flags=re.IGNORECASE if ignore_case else 0) is not None


_OPERATORS = {
    "StringLike": lambda patterns, value: any(_wildcard(p, value) for p in patterns),
    "StringEquals": lambda patterns, value: value in patterns,
}


def _conditions_hold(condition: dict[str, Any], context: dict[str, str]) -> bool:
    for operator, clauses in condition.items():
        if operator not in _OPERATORS:
            raise ValueError(f"condition operator {operator!r} is not supported by this check")
        for key, patterns in clauses.items():
            if key not in context:
                # IAM: a condition on a key the request does not carry does not match.
                return False
            if not _OPERATORS[operator](_as_list(patterns), context[key]):
                return False
    return True


def _statement_matches(statement: dict[str, Any], permission: Permission) -> bool:
    for unsupported in ("NotAction", "NotResource", "Principal", "NotPrincipal"):
        if unsupported in statement:
            raise ValueError(f"policy element {unsupported!r} is not supported by this check")
    if not any(_wildcard(p, permission.action, ignore_case=True) for p in _as_list(statement["Action"])):
        return False
    if not any(_wildcard(p, permission.resource) for p in _as_list(statement["Resource"])):
        return False
    return _conditions_hold(statement.get("Condition", {}), dict(permission.context))


def is_allowed(policy: dict[str, Any], permission: Permission) -> bool:
    """Whether an identity policy allows one check (explicit Deny > Allow > implicit deny)."""
    statements = policy["Statement"]
    statements = [statements] if isinstance(statements, dict) else statements
    matching = [s for s in statements if _statement_matches(s, permission)]
    if any(s["Effect"] == "Deny" for s in matching):
        return False
    return any(s["Effect"] == "Allow" for s in matching)


def policy_actions(policy: dict[str, Any]) -> set[str]:
    """Every action an Allow statement names (lower-cased, as IAM compares them)."""
    statements = policy["Statement"]
    statements = [statements] if isinstance(statements, dict) else statements
    return {a.lower() for s in statements if s["Effect"] == "Allow" for a in _as_list(s["Action"])}


__all__ = ["Permission", "UnknownS3Request", "is_allowed", "policy_actions", "required_permissions"]
