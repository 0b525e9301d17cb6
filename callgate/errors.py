"""One exception hierarchy for callgate, with classified reasons.

Every bad input ends in a `Reason`: a short, stable, low-cardinality code that
is safe to log, count as a metric label and put on the audit and dead-letter
topics. Exception messages never carry raw tool arguments, prompts or file
contents: build them from reasons, sizes and opaque ids only.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # SSE framing (ingest decoder)
    SSE_LINE_TOO_LONG = "sse_line_too_long"
    SSE_MESSAGE_TOO_LARGE = "sse_message_too_large"
    SSE_INCOMPLETE_AT_EOF = "sse_incomplete_at_eof"

    # transport (ingest worker)
    TRANSPORT_EOF = "transport_eof"
    TRANSPORT_IDLE_TIMEOUT = "transport_idle_timeout"
    TRANSPORT_TOTAL_TIMEOUT = "transport_total_timeout"
    TRANSPORT_CONNECT_ERROR = "transport_connect_error"
    TRANSPORT_DISCONNECT = "transport_disconnect"
    TRANSPORT_HTTP_STATUS = "transport_http_status"
    TRANSPORT_CANCELLED = "transport_cancelled"

    # stream / item lifecycle (normalizer)
    STREAM_ERROR = "stream_error"
    STREAM_ENDED_BEFORE_TERMINAL = "stream_ended_before_terminal"
    RUN_IDLE_DEADLINE = "run_idle_deadline"
    DUPLICATE_ITEM = "duplicate_item"
    ID_REUSE = "id_reuse"
    DELTA_FOR_UNKNOWN_ITEM = "delta_for_unknown_item"
    DELTA_AFTER_TERMINAL = "delta_after_terminal"
    UNKNOWN_ATTEMPT = "unknown_attempt"  # a record for an attempt the normalizer has no open state for
    MALFORMED_PROVIDER_EVENT = "malformed_provider_event"
    ITEM_TOO_LARGE = "item_too_large"
    UNKNOWN_ROUTE = "unknown_route"

    # strict parse (validator)
    NOT_UTF8 = "not_utf8"
    BOM_PRESENT = "bom_present"
    BUFFER_TOO_LARGE = "buffer_too_large"
    NESTING_TOO_DEEP = "nesting_too_deep"
    INVALID_JSON = "invalid_json"
    TRAILING_DATA = "trailing_data"
    EMPTY_BUFFER = "empty_buffer"
    NON_FINITE_NUMBER = "non_finite_number"
    INTEGER_OUT_OF_RANGE = "integer_out_of_range"
    DUPLICATE_KEY = "duplicate_key"
    LONE_SURROGATE = "lone_surrogate"
    NOT_AN_OBJECT = "not_an_object"

    # registry and schema (validator)
    UNKNOWN_TOOL = "unknown_tool"
    TOOL_NOT_IN_RUN = "tool_not_in_run"
    SCHEMA_INVALID = "schema_invalid"

    # policy (validator)
    PATH_ESCAPE = "path_escape"
    PATH_ABSOLUTE = "path_absolute"
    PATH_INVALID = "path_invalid"
    PATH_NUL_BYTE = "path_nul_byte"
    PATH_SYMLINK_ESCAPE = "path_symlink_escape"
    PATH_DENIED = "path_denied"
    COMMAND_NOT_ALLOWED = "command_not_allowed"
    COMMAND_ARGUMENT_DENIED = "command_argument_denied"
    ENV_DENIED = "env_denied"
    HOST_NOT_ALLOWED = "host_not_allowed"
    HEADER_DENIED = "header_denied"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CALL_CAP_EXCEEDED = "call_cap_exceeded"
    UNKNOWN_POLICY = "unknown_policy"
    POLICY_ERROR = "policy_error"

    # approval (validator)
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    APPROVAL_MISMATCH = "approval_mismatch"

    # execution (executor)
    SIGNATURE_INVALID = "signature_invalid"
    IN_DOUBT = "in_doubt"
    TOOL_FAILED = "tool_failed"
    TOOL_TIMEOUT = "tool_timeout"
    SANDBOX_VIOLATION = "sandbox_violation"
    INTERRUPTED = "interrupted"  # a side-effect-free call cut short by a crash; not re-run

    # records and plumbing
    RECORD_UNDECODABLE = "record_undecodable"
    UNKNOWN_SCHEMA = "unknown_schema"


class CallgateError(Exception):
    """Base of every error callgate raises on purpose.

    `detail` must be safe to log: sizes, counts, opaque ids, keyword names.
    """

    reason: Reason

    def __init__(self, reason: Reason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


class SseError(CallgateError):
    """The event-stream framing broke a limit."""


class TransportError(CallgateError):
    """The HTTP stream ended in a way other than a clean end of stream."""


class StreamError(CallgateError):
    """A provider stream or item broke its lifecycle contract."""


class ParseError(CallgateError):
    """A terminal buffer is not exactly one strict JSON object."""


class SchemaError(CallgateError):
    """A parsed call does not match its tool, registry or schema."""


class PolicyError(CallgateError):
    """A schema-valid call is denied by policy."""


class ApprovalError(CallgateError):
    """A human approval was denied, expired or does not match the call."""


class ExecutionError(CallgateError):
    """The executor refused, or a tool failed, or the outcome is unknown."""


class RecordError(CallgateError):
    """A Kafka record could not be decoded. Carries where it was."""

    def __init__(
        self,
        reason: Reason,
        detail: str = "",
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        where = f"{topic}[{partition}]@{offset}" if topic is not None else "unknown position"
        super().__init__(reason, f"{where}: {detail}" if detail else where)
