"""Record types carried on the topics, one per Avro schema in `schemas/`.

Field names here are the Avro field names (the codec maps one to the other
with no renaming). Times are integer milliseconds since the epoch (Avro
`timestamp-millis`). Ids are opaque random strings, never derived from content.

Restricted records (raw arguments, request bodies) are marked; the audit
record and the dead-letter record never carry raw arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RunRequest:
    """callgate.runs: a fleet asks ingest to stream one run. Restricted."""

    run_id: str
    route: str
    model: str
    upstream_url: str
    request_body: bytes
    tool_set: list[str]
    policy_id: str
    submitted_at: int
    api_key_env: str | None = None  # name of the env var holding the key, never the key


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    """callgate.sse.raw: first record of every attempt, so later stages know its context."""

    run_id: str
    attempt_id: str
    attempt_number: int
    route: str
    adapter_version: str
    model: str
    tool_set: list[str]
    policy_id: str
    started_at: int


@dataclass(frozen=True, slots=True)
class RawSseMessage:
    """callgate.sse.raw: one complete SSE message as the decoder dispatched it. Restricted."""

    run_id: str
    attempt_id: str
    seq: int  # per attempt, from 0, counting every record of the attempt
    route: str
    adapter_version: str
    received_at: int
    event: str  # "message" when the stream named none
    data: str
    last_event_id: str | None = None
    retry_ms: int | None = None


@dataclass(frozen=True, slots=True)
class TransportEnd:
    """callgate.sse.raw: the explicit last record of every attempt."""

    run_id: str
    attempt_id: str
    seq: int
    route: str
    reason: str  # a transport Reason value, e.g. "transport_eof"
    ended_at: int
    bytes_received: int
    messages: int
    http_status: int | None = None
    incomplete_message: bool = False  # the decoder held an undispatched message at the end
    will_retry: bool = False


@dataclass(frozen=True, slots=True)
class TerminalItem:
    """callgate.items: a tool-call item whose provider terminal event arrived. Restricted."""

    run_id: str
    attempt_id: str
    response_id: str
    item_id: str  # the accumulator key's item part (provider item id, call id or index)
    call_id: str  # callgate's own opaque id for this call, random
    provider_call_id: str | None
    tool_name: str
    arguments: bytes  # the whole buffer, exactly as accumulated
    route: str
    adapter_version: str
    provider_event: str  # the provider event type that closed the item
    tool_set: list[str]
    policy_id: str
    terminal_at: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """callgate.dlq: an item that ended QUARANTINED, REJECTED or IN_DOUBT. No raw arguments."""

    stage: str  # normalizer | validator | executor
    state: str  # an ItemState value
    reason: str  # a Reason value
    run_id: str
    attempt_id: str
    response_id: str | None
    item_id: str | None
    call_id: str | None
    route: str
    tool_category: str | None
    byte_count: int
    last_provider_event: str | None
    observed_at: int
    detail_code: str | None = None  # e.g. the failing JSON Schema keyword


@dataclass(frozen=True, slots=True)
class QuarantinedBuffer:
    """callgate.quarantine: a quarantined item's raw bytes, only when data handling is `keep`. Restricted."""

    run_id: str
    attempt_id: str
    response_id: str
    item_id: str
    call_id: str  # the call id of the matching DeadLetter
    reason: str
    arguments: bytes  # the buffer as accumulated when the item was quarantined
    observed_at: int


@dataclass(frozen=True, slots=True)
class PendingCall:
    """callgate.calls.pending: a valid call waiting for a person. Restricted."""

    call_id: str
    run_id: str
    attempt_id: str
    response_id: str
    item_id: str
    tool_name: str
    arguments: bytes  # canonical JSON
    args_hmac: str
    policy_id: str
    policy_version: str
    route: str
    requested_at: int
    expires_at: int
    why: str  # the policy rule that asked for approval (a rule name, not content)


@dataclass(frozen=True, slots=True)
class Approval:
    """callgate.approvals: a person's answer to a pending call."""

    call_id: str
    decision: str  # approve | deny | expire (expire: the validator's own deadline marker)
    decided_by: str
    decided_at: int
    why: str | None = None
    run_id: str | None = None  # also the Kafka key, so one validator owns the pending call and its answer
    args_hmac: str | None = None  # the pending call's args_hmac the person saw; binds the answer to those args


@dataclass(frozen=True, slots=True)
class ApprovedCall:
    """callgate.calls.approved: a call the validator signed for execution. Restricted."""

    call_id: str
    run_id: str
    attempt_id: str
    response_id: str
    item_id: str
    tool_name: str
    arguments: bytes  # canonical JSON, exactly what was validated
    policy_id: str
    policy_version: str
    workspace: str
    route: str
    approved_at: int
    approved_by: str  # "policy" or the approver's name
    key_id: str
    signature: str  # hex HMAC-SHA256 over the canonical content


@dataclass(frozen=True, slots=True)
class ToolResult:
    """callgate.results: what happened when the executor ran an approved call. Restricted."""

    call_id: str
    run_id: str
    item_id: str
    tool_name: str
    state: str  # EXECUTED | FAILED | IN_DOUBT
    started_at: int
    finished_at: int
    duration_ms: int
    output: bytes  # truncated to the tool's cap
    output_bytes: int  # before truncation
    truncated: bool
    exit_code: int | None = None
    error_class: str | None = None


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """callgate.executor.ledger (compacted, keyed by call id): the decision before the side effect."""

    call_id: str
    run_id: str
    tool_name: str
    phase: str  # STARTED | FINISHED | IN_DOUBT
    state: str | None  # final ItemState once FINISHED or IN_DOUBT
    updated_at: int
    intent_digest: str | None = None  # keyed HMAC of the intended effect, for reconcile
    executor_id: str | None = None


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """callgate.audit: the reference guide's decision record. Sanitized: no raw content."""

    observed_at: int
    stage: str
    run_id: str
    attempt_id: str | None
    response_id: str | None
    item_id: str | None
    call_id: str | None
    model_route: str
    stream_event: str | None
    tool_name: str | None  # or an internal category
    buffer_bytes: int | None
    terminal_seen: bool
    json_status: str | None  # valid | <reason> | None when not reached
    trailing_data: bool | None
    schema_status: str | None
    policy_status: str | None  # approved | pending | denied
    execution_state: str | None
    state: str  # the ItemState this record reports
    error_class: str | None = None
    content_hmac: str | None = None  # only when content correlation is configured
    extra: dict[str, str] = field(default_factory=dict)  # sanitized counters, e.g. unknown events
