"""The validator's pure decision pipeline (no Kafka, no httpx).

API, also used by `callgate check` (the embedded mode):

    from validator.core import Validator, RunState, Approved, Pending, Rejected
    from validator.registry import ToolRegistry
    from validator.policy import PolicySet

    validator = Validator(ToolRegistry.load_dir(schema_dir), PolicySet.load(policy_file_or_dir))
    state = RunState(run_id)              # one per run; counts calls for the cap
    decision = validator.decide(item, state, now_ms=item.terminal_at)

`item` is a `callgate.records.TerminalItem`. `decide` never raises on bad
input: every outcome is a Decision:

- `Approved(arguments, value, policy_id, policy_version, workspace, audit)`:
  `arguments` are the canonical JSON bytes of the *authorised* form (paths
  relative to the workspace, argv[0] an absolute program path); the
  executor runs exactly these.
- `Pending(arguments, value, policy_id, policy_version, workspace, why,
  expires_at, audit)`: valid, but the policy rule `why` wants a person.
- `Rejected(reason, detail_code, stage, audit)`: `stage` is where it stopped
  (parse | schema | policy), `detail_code` is a safe code (the failing JSON
  Schema keyword, or a policy sub-rule such as "dotdot_segment").

Every decision carries `audit: AuditFields` with the sanitized fields of the
audit record (json_status, trailing_data, schema_status, policy_status,
error_class, buffer_bytes); `decision.state` is the ItemState it reached.

Order: strict parse -> registry / run tool set / schema -> policy. The only
state `decide` touches is `RunState.calls_counted`: a call that passes the
schema counts against the policy's `max_calls_per_run`, whatever the policy
then decides (a model that keeps asking for denied things spends its budget).
Any unexpected exception inside a policy check is a denial (POLICY_ERROR).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from callgate.errors import CallgateError, ParseError, PolicyError, Reason, SchemaError
from callgate.records import TerminalItem
from callgate.signing import canonical_json
from callgate.states import ItemState

from validator.policy import PolicySet
from validator.registry import SchemaInvalid, ToolRegistry
from validator.strict_json import MAX_BUFFER_BYTES, MAX_DEPTH, FrozenDict, parse_arguments

DEFAULT_APPROVAL_TTL_MS = 15 * 60 * 1000


class Stage(StrEnum):
    PARSE = "parse"
    SCHEMA = "schema"
    POLICY = "policy"
    APPROVAL = "approval"


@dataclass(frozen=True, slots=True)
class AuditFields:
    buffer_bytes: int
    json_status: str | None = None  # "valid" | a parse Reason value | None (not reached)
    trailing_data: bool | None = None
    schema_status: str | None = None  # "valid" | a registry/schema Reason value
    policy_status: str | None = None  # "approved" | "pending" | "denied"
    error_class: str | None = None  # the Reason value of a rejection
    detail_code: str | None = None


@dataclass(frozen=True, slots=True)
class Approved:
    arguments: bytes
    value: FrozenDict
    policy_id: str
    policy_version: str
    workspace: str
    audit: AuditFields
    state: ItemState = ItemState.POLICY_APPROVED


@dataclass(frozen=True, slots=True)
class Pending:
    arguments: bytes
    value: FrozenDict
    policy_id: str
    policy_version: str
    workspace: str
    why: str
    expires_at: int
    audit: AuditFields
    state: ItemState = ItemState.PENDING_APPROVAL


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Reason
    detail_code: str | None
    stage: Stage
    audit: AuditFields
    state: ItemState = ItemState.REJECTED


Decision = Approved | Pending | Rejected


@dataclass(slots=True)
class RunState:
    """Per-run state the validator keeps (restored by the worker after a restart)."""

    run_id: str
    calls_counted: int = 0
    # call ids already decided, so a redelivered item is not counted twice
    decided: set[str] = field(default_factory=set)


class Validator:
    def __init__(
        self,
        registry: ToolRegistry,
        policies: PolicySet,
        *,
        approval_ttl_ms: int = DEFAULT_APPROVAL_TTL_MS,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        max_depth: int = MAX_DEPTH,
    ) -> None:
        self.registry = registry
        self.policies = policies
        self.approval_ttl_ms = approval_ttl_ms
        self.max_buffer_bytes = max_buffer_bytes
        self.max_depth = max_depth

    def decide(self, item: TerminalItem, run_state: RunState, now_ms: int | None = None) -> Decision:
        now = item.terminal_at if now_ms is None else now_ms
        size = len(item.arguments)

        try:
            parsed = parse_arguments(item.arguments, max_bytes=self.max_buffer_bytes, max_depth=self.max_depth)
        except ParseError as exc:
            audit = AuditFields(
                buffer_bytes=size,
                json_status=exc.reason.value,
                trailing_data=True if exc.reason is Reason.TRAILING_DATA else None,
                error_class=exc.reason.value,
            )
            return Rejected(exc.reason, None, Stage.PARSE, audit)

        try:
            self.registry.check(item.tool_name, item.tool_set, parsed.value)
        except SchemaError as exc:
            detail = exc.keyword if isinstance(exc, SchemaInvalid) else None
            audit = AuditFields(
                buffer_bytes=size, json_status="valid", trailing_data=False,
                schema_status=exc.reason.value, error_class=exc.reason.value, detail_code=detail,
            )
            return Rejected(exc.reason, detail, Stage.SCHEMA, audit)

        def denied(reason: Reason, detail: str | None) -> Rejected:
            audit = AuditFields(
                buffer_bytes=size, json_status="valid", trailing_data=False, schema_status="valid",
                policy_status="denied", error_class=reason.value, detail_code=detail,
            )
            return Rejected(reason, detail, Stage.POLICY, audit)

        policy = self.policies.get(item.policy_id)
        if policy is None:
            return denied(Reason.UNKNOWN_POLICY, None)

        if item.call_id not in run_state.decided:
            run_state.decided.add(item.call_id)
            run_state.calls_counted += 1
        if run_state.calls_counted > policy.max_calls_per_run:
            return denied(Reason.CALL_CAP_EXCEEDED, None)

        try:
            outcome = policy.evaluate(item.tool_name, parsed.value)
            arguments = canonical_json(outcome.args)
        except PolicyError as exc:
            return denied(exc.reason, exc.detail or None)
        except CallgateError as exc:
            return denied(Reason.POLICY_ERROR, exc.reason.value)
        except Exception as exc:  # noqa: BLE001 - a broken policy check denies, never approves
            return denied(Reason.POLICY_ERROR, type(exc).__name__)

        if outcome.approval_rule is not None:
            audit = AuditFields(
                buffer_bytes=size, json_status="valid", trailing_data=False,
                schema_status="valid", policy_status="pending",
            )
            return Pending(
                arguments=arguments, value=outcome.args, policy_id=policy.policy_id,
                policy_version=policy.version, workspace=policy.workspace_root,
                why=outcome.approval_rule, expires_at=now + self.approval_ttl_ms, audit=audit,
            )
        audit = AuditFields(
            buffer_bytes=size, json_status="valid", trailing_data=False,
            schema_status="valid", policy_status="approved",
        )
        return Approved(
            arguments=arguments, value=outcome.args, policy_id=policy.policy_id,
            policy_version=policy.version, workspace=policy.workspace_root, audit=audit,
        )
