"""HMAC-SHA256 over an approved call's canonical content.

The validator signs; the executor verifies and refuses anything else. The
canonical content is every field of `ApprovedCall` except the signature,
as JSON with sorted keys, no whitespace, UTF-8, and the arguments (already
canonical JSON bytes) embedded as a string, so one byte changed anywhere
changes the MAC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

from callgate.errors import ExecutionError, Reason
from callgate.records import ApprovedCall


def canonical_json(value: object) -> bytes:
    """The one canonical serialisation callgate uses for MACs and approved arguments."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def approved_call_content(call: ApprovedCall) -> bytes:
    fields = dataclasses.asdict(call)
    del fields["signature"]
    fields["arguments"] = call.arguments.decode("utf-8")
    return canonical_json(fields)


def sign(call: ApprovedCall, key: bytes) -> ApprovedCall:
    """Return the call with its signature set."""
    mac = hmac.new(key, approved_call_content(call), hashlib.sha256).hexdigest()
    return dataclasses.replace(call, signature=mac)


def verify(call: ApprovedCall, keys: dict[str, bytes]) -> None:
    """Raise ExecutionError(SIGNATURE_INVALID) unless a known key signed exactly this content."""
    key = keys.get(call.key_id)
    if key is None:
        raise ExecutionError(Reason.SIGNATURE_INVALID, "unknown key id")
    try:
        content = approved_call_content(call)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ExecutionError(Reason.SIGNATURE_INVALID, "content not canonical") from exc
    expected = hmac.new(key, content, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, call.signature):
        raise ExecutionError(Reason.SIGNATURE_INVALID, "mac mismatch")


def keyed_digest(key: bytes, content: bytes) -> str:
    """Full-length keyed HMAC for content correlation (never a bare or truncated hash)."""
    return hmac.new(key, content, hashlib.sha256).hexdigest()
