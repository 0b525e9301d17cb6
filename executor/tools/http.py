"""http_request through httpx, to an allow-listed host only.

The host allowlist is re-checked here on the exact URL that is sent. Redirects
are not followed (a 30x to another host would bypass the allowlist; the agent
gets the 30x). httpx's environment trust is off, so no proxy variables or
.netrc credentials of the executor leak into a model-chosen request.
"""

from __future__ import annotations

from typing import Any

import httpx

from callgate.errors import ExecutionError, Reason
from callgate.hosts import host_allowed
from callgate.states import ItemState
from executor.tools.base import ToolContext, ToolOutcome

_REFUSED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "proxy-authorization"})


def checked_url(url: str, allowed_hosts: frozenset[str]) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "url refused") from None
    if parsed.scheme not in ("http", "https") or parsed.userinfo:
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "url form refused")
    if not host_allowed(parsed.host.lower().rstrip("."), allowed_hosts):
        raise ExecutionError(Reason.HOST_NOT_ALLOWED, "host not in allowlist")
    return parsed


def http_request(args: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    url = checked_url(args["url"], ctx.allowed_hosts)
    headers = dict(args.get("headers") or {})
    if any(name.lower() in _REFUSED_HEADERS for name in headers):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "header refused")
    body = args.get("body")
    limit = ctx.limits.http_max_response_bytes
    try:
        with httpx.Client(
            timeout=ctx.limits.http_timeout_s, follow_redirects=False, trust_env=False
        ) as client, client.stream(
            args["method"], url, headers=headers, content=body.encode("utf-8") if body is not None else None
        ) as response:
            chunks: list[bytes] = []
            kept = 0
            total = 0
            for chunk in response.iter_raw():
                total += len(chunk)
                if kept < limit:
                    piece = chunk[: limit - kept]
                    chunks.append(piece)
                    kept += len(piece)
                if total > limit:
                    break  # stop reading: the size past the cap is not worth downloading
            status = response.status_code
    except httpx.TimeoutException:
        return ToolOutcome(ItemState.FAILED, error_class=Reason.TOOL_TIMEOUT.value)
    except httpx.HTTPError:
        return ToolOutcome(ItemState.FAILED, error_class=Reason.TOOL_FAILED.value)
    return ToolOutcome(ItemState.EXECUTED, b"".join(chunks), total, total > limit, status)
