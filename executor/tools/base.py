"""What every built-in tool takes and returns.

A tool gets the parsed arguments (already schema-valid and policy-approved)
and a `ToolContext`, and returns a `ToolOutcome`. It raises
`ExecutionError(SANDBOX_VIOLATION)` when something it re-checks at execution
time no longer holds (a symlink swapped in after validation, a host that left
the allowlist); the runner turns that into a FAILED outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from callgate.states import ItemState

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    read_max_bytes: int = 1 * MiB
    output_max_bytes: int = 64 * 1024
    list_max_entries: int = 1000
    command_timeout_s: float = 60.0
    command_max_timeout_s: float = 600.0
    command_file_size_bytes: int = 256 * MiB  # RLIMIT_FSIZE for the child
    command_address_space_bytes: int = 4096 * MiB  # RLIMIT_AS for the child
    http_timeout_s: float = 30.0
    http_max_response_bytes: int = 1 * MiB


@dataclass(frozen=True, slots=True)
class ToolContext:
    workspace: str  # absolute path of the run's workspace root
    allowed_hosts: frozenset[str] = frozenset()  # the policy's http_request allowlist
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    state: ItemState  # EXECUTED or FAILED
    output: bytes = b""  # already truncated to the tool's cap
    output_bytes: int = 0  # before truncation
    truncated: bool = False
    exit_code: int | None = None  # process exit code; HTTP status for http_request
    error_class: str | None = None  # a Reason value when FAILED


def cap(data: bytes, limit: int, total: int | None = None) -> tuple[bytes, int, bool]:
    """(kept bytes, size before truncation, truncated?)."""
    size = len(data) if total is None else total
    return data[:limit], size, size > limit
