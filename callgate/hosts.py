"""Host allowlist matching, shared by the validator's policy and the executor's re-check.

One function on both sides of the gate, so the two can never disagree about
what an allowlist entry means: an exact name, or "*.example.com" for strict
subdomains (never the bare domain, never "evil-example.com").
"""

from __future__ import annotations

from collections.abc import Iterable


def host_allowed(host: str, allowed_hosts: Iterable[str]) -> bool:
    host = host.lower().rstrip(".")
    for entry in (h.lower().rstrip(".") for h in allowed_hosts):
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and host != entry[2:]:
                return True
        elif host == entry:
            return True
    return False
