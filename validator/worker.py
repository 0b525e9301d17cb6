"""The validator worker: `callgate.items` + pending + approvals in, decisions out.

Inputs (all keyed by run id and co-partitioned, so partition p of each goes
to one owner): `items` (terminal items), `calls.pending` (the pending calls
this stage wrote itself, read back), `approvals` (people's answers and the
validator's own `expire` markers). Outputs, in the same Kafka transaction as
the input offsets: `calls.approved` (signed ApprovedCall), `calls.pending`,
`dlq` (rejections, no raw arguments), `audit` (sanitized decision records),
and `approvals` (expire markers written by the deadline tick).

State and recovery, by deterministic replay (no changelog topic):
- per-run call counts come from re-deciding the run's items; runs idle for
  `run_state_ttl_s` (by record time) are dropped;
- open pending calls and early answers come from replaying `calls.pending`
  and `approvals`; every resolution is caused by a record in `approvals`
  (see validator/approvals.py), so a replay ends in the same state.
`commit_metadata()` stores, with every committed offset, the offsets from
which a replay rebuilds the state; a new owner re-reads from there up to the
committed offsets and discards the outputs of that replay (they were
committed already).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord, TopicPartition

from callgate import metrics
from callgate.avro import decode, encode
from callgate.errors import Reason, RecordError
from callgate.kafka import OffsetAndMetadata, Output, PartitionReader, run_transactional_stage
from callgate.logging import configure_logging, get_logger
from callgate.records import (
    Approval, ApprovedCall, AuditRecord, DeadLetter, PendingCall, TerminalItem,
)
from callgate.settings import Settings
from callgate.signing import keyed_digest, sign
from callgate.states import ItemState
from callgate.topics import TopicNames

from validator.approvals import ApprovalJoin, Granted, Refused, args_hmac, expire_marker, pending_hmac_ok
from validator.core import Approved, AuditFields, Pending, Rejected, RunState, Validator
from validator.policy import PolicySet
from validator.registry import ToolRegistry

log = get_logger("callgate.validator")
STAGE = "validator"
METADATA_VERSION = 1


@dataclass(slots=True)
class _Run:
    state: RunState
    first_offset: int
    last_seen_ms: int


@dataclass(slots=True)
class ValidatorProcessor:
    """One partition's validator state; `process` is pure apart from the state it keeps."""

    validator: Validator
    topics: TopicNames
    signing_key: bytes
    key_id: str
    run_state_ttl_ms: int
    # set only when content correlation is configured: audit records then carry a keyed HMAC
    # of the canonical arguments (full length, never a bare or truncated hash)
    content_key: bytes | None = None
    runs: dict[str, _Run] = field(default_factory=dict)
    join: ApprovalJoin = field(default_factory=lambda: ApprovalJoin(orphan_ttl_ms=24 * 3600 * 1000))
    next_offsets: dict[str, int] = field(default_factory=dict)  # per input topic
    stream_time_ms: int = 0
    live: bool = True  # False while replaying: those records were counted when first processed

    # ------------------------------------------------------------ protocol

    def process(self, records: list[ConsumerRecord]) -> list[Output]:
        metrics.record_event(STAGE, len(records))
        outputs: list[Output] = []
        for record in records:
            outputs.extend(self._one(record))
        return outputs

    def replay(self, records: Iterable[ConsumerRecord]) -> None:
        self.live = False
        try:
            for record in records:
                self._one(record)  # outputs were committed by the previous owner
        finally:
            self.live = True

    def tick(self, now_ms: int) -> list[Output]:
        return [
            Output(self.topics.approvals, p.run_id.encode(), encode(expire_marker(p, now_ms)))
            for p in self.join.due(now_ms)
        ]

    def commit_metadata(self) -> str:
        t = self.topics
        items_next = self.next_offsets.get(t.items, 0)
        items_from = min((r.first_offset for r in self.runs.values()), default=items_next)
        pending_from, approvals_from = self.join.replay_from(
            self.next_offsets.get(t.calls_pending, 0), self.next_offsets.get(t.approvals, 0)
        )
        return json.dumps(
            {"v": METADATA_VERSION, "replay": {t.items: items_from, t.calls_pending: pending_from,
                                                t.approvals: approvals_from}},
            separators=(",", ":"),
        )

    # ------------------------------------------------------------ records

    def _one(self, record: ConsumerRecord) -> list[Output]:
        self.next_offsets[record.topic] = record.offset + 1
        self.stream_time_ms = max(self.stream_time_ms, record.timestamp)
        try:
            value = decode(record.value, topic=record.topic, partition=record.partition, offset=record.offset)
        except RecordError as exc:
            return self._undecodable(record, exc)
        if record.topic == self.topics.items and isinstance(value, TerminalItem):
            outputs = self._item(value, record)
        elif record.topic == self.topics.calls_pending and isinstance(value, PendingCall):
            outputs = self._resolutions(self.join.add_pending(value, record.offset))
        elif record.topic == self.topics.approvals and isinstance(value, Approval):
            outputs = self._resolutions(self.join.on_approval(value, record.offset))
        else:
            outputs = self._undecodable(record, RecordError(Reason.UNKNOWN_SCHEMA, "unexpected record type"))
        self._evict()
        return outputs

    def _item(self, item: TerminalItem, record: ConsumerRecord) -> list[Output]:
        run = self.runs.get(item.run_id)
        if run is None:
            run = self.runs[item.run_id] = _Run(RunState(item.run_id), record.offset, record.timestamp)
        run.last_seen_ms = max(run.last_seen_ms, record.timestamp)
        decision = self.validator.decide(item, run.state, now_ms=record.timestamp)
        if self.live:
            metrics.record_decision(STAGE, decision.state, getattr(decision, "reason", None))
            metrics.observe_decision_latency(STAGE, item.terminal_at)
        key = item.run_id.encode()
        t = self.topics
        tool = self._tool_label(item.tool_name)
        if isinstance(decision, Approved):
            call = sign(
                ApprovedCall(
                    call_id=item.call_id, run_id=item.run_id, attempt_id=item.attempt_id,
                    response_id=item.response_id, item_id=item.item_id, tool_name=item.tool_name,
                    arguments=decision.arguments, policy_id=decision.policy_id,
                    policy_version=decision.policy_version, workspace=decision.workspace,
                    route=item.route, approved_at=record.timestamp, approved_by="policy",
                    key_id=self.key_id, signature="",
                ),
                self.signing_key,
            )
            log.info("call approved", stage=STAGE, run_id=item.run_id, call_id=item.call_id, tool=tool,
                     bytes=decision.audit.buffer_bytes)
            return [Output(t.calls_approved, key, encode(call)),
                    self._audit(item, decision.audit, decision.state, record.timestamp,
                                content=decision.arguments)]
        if isinstance(decision, Pending):
            pending = PendingCall(
                call_id=item.call_id, run_id=item.run_id, attempt_id=item.attempt_id,
                response_id=item.response_id, item_id=item.item_id, tool_name=item.tool_name,
                arguments=decision.arguments,
                args_hmac=args_hmac(
                    self.signing_key, call_id=item.call_id, tool_name=item.tool_name,
                    arguments=decision.arguments, policy_id=decision.policy_id,
                    policy_version=decision.policy_version,
                ),
                policy_id=decision.policy_id, policy_version=decision.policy_version, route=item.route,
                requested_at=record.timestamp, expires_at=decision.expires_at, why=decision.why,
            )
            log.info("call pending approval", stage=STAGE, run_id=item.run_id, call_id=item.call_id,
                     tool=tool, detail_code=decision.why)
            return [Output(t.calls_pending, key, encode(pending)),
                    self._audit(item, decision.audit, decision.state, record.timestamp,
                                content=decision.arguments)]
        assert isinstance(decision, Rejected)
        log.info("call rejected", stage=STAGE, run_id=item.run_id, call_id=item.call_id, tool=tool,
                 reason=decision.reason.value, detail_code=decision.detail_code)
        dead = DeadLetter(
            stage=STAGE, state=ItemState.REJECTED.value, reason=decision.reason.value, run_id=item.run_id,
            attempt_id=item.attempt_id, response_id=item.response_id, item_id=item.item_id,
            call_id=item.call_id, route=item.route, tool_category=tool,
            byte_count=decision.audit.buffer_bytes, last_provider_event=item.provider_event,
            observed_at=record.timestamp, detail_code=decision.detail_code,
        )
        return [Output(t.dlq, key, encode(dead)),
                self._audit(item, decision.audit, decision.state, record.timestamp,
                            extra={"stage_reached": decision.stage.value})]

    def _resolutions(self, resolutions: list[Granted | Refused]) -> list[Output]:
        outputs: list[Output] = []
        for resolution in resolutions:
            pending = resolution.pending
            key = pending.run_id.encode()
            outcome: Granted | Refused = resolution
            policy = self.validator.policies.get(pending.policy_id)
            if isinstance(resolution, Granted):
                if not pending_hmac_ok(self.signing_key, pending):
                    outcome = Refused(pending, Reason.APPROVAL_MISMATCH, "pending_hmac", resolution.approval)
                elif policy is None or policy.version != pending.policy_version:
                    # the approval bound to a policy version that is no longer in force
                    outcome = Refused(pending, Reason.APPROVAL_MISMATCH, "policy_version", resolution.approval)
            approval = resolution.approval
            if isinstance(outcome, Granted) and policy is not None:
                call = sign(
                    ApprovedCall(
                        call_id=pending.call_id, run_id=pending.run_id, attempt_id=pending.attempt_id,
                        response_id=pending.response_id, item_id=pending.item_id, tool_name=pending.tool_name,
                        arguments=pending.arguments, policy_id=pending.policy_id,
                        policy_version=pending.policy_version, workspace=policy.workspace_root,
                        route=pending.route, approved_at=approval.decided_at,
                        approved_by=approval.decided_by, key_id=self.key_id, signature="",
                    ),
                    self.signing_key,
                )
                outputs.append(Output(self.topics.calls_approved, key, encode(call)))
                outputs.append(self._pending_audit(pending, ItemState.POLICY_APPROVED, "approved", None, approval))
                if self.live:
                    metrics.record_decision(STAGE, ItemState.POLICY_APPROVED, None)
                log.info("pending call approved", stage=STAGE, run_id=pending.run_id, call_id=pending.call_id)
                continue
            assert isinstance(outcome, Refused)
            dead = DeadLetter(
                stage=STAGE, state=ItemState.REJECTED.value, reason=outcome.reason.value, run_id=pending.run_id,
                attempt_id=pending.attempt_id, response_id=pending.response_id, item_id=pending.item_id,
                call_id=pending.call_id, route=pending.route, tool_category=self._tool_label(pending.tool_name),
                byte_count=len(pending.arguments), last_provider_event=None,
                observed_at=approval.decided_at, detail_code=outcome.detail_code,
            )
            outputs.append(Output(self.topics.dlq, key, encode(dead)))
            outputs.append(self._pending_audit(pending, ItemState.REJECTED, "denied", outcome.reason, approval))
            if self.live:
                metrics.record_decision(STAGE, ItemState.REJECTED, outcome.reason)
            log.info("pending call refused", stage=STAGE, run_id=pending.run_id, call_id=pending.call_id,
                     reason=outcome.reason.value, detail_code=outcome.detail_code)
        return outputs

    # ------------------------------------------------------------ helpers

    def _tool_label(self, name: str) -> str:
        # an unregistered name is model-chosen text: never log or publish it
        return name if self.validator.registry.get(name) is not None else "unregistered"

    def _content_hmac(self, content: bytes | None) -> str | None:
        if self.content_key is None or content is None:
            return None
        return keyed_digest(self.content_key, content)

    def _audit(self, item: TerminalItem, audit: AuditFields, state: ItemState, now: int,
               extra: dict[str, str] | None = None, content: bytes | None = None) -> Output:
        fields = dict(extra or {})
        if audit.detail_code:
            fields["detail_code"] = audit.detail_code
        record = AuditRecord(
            observed_at=now, stage=STAGE, run_id=item.run_id, attempt_id=item.attempt_id,
            response_id=item.response_id, item_id=item.item_id, call_id=item.call_id,
            model_route=item.route, stream_event=item.provider_event,
            tool_name=self._tool_label(item.tool_name), buffer_bytes=audit.buffer_bytes,
            terminal_seen=True, json_status=audit.json_status, trailing_data=audit.trailing_data,
            schema_status=audit.schema_status, policy_status=audit.policy_status, execution_state=None,
            state=state.value, error_class=audit.error_class, extra=fields,
            content_hmac=self._content_hmac(content),
        )
        return Output(self.topics.audit, item.run_id.encode(), encode(record))

    def _pending_audit(self, pending: PendingCall, state: ItemState, policy_status: str,
                       reason: Reason | None, approval: Approval) -> Output:
        record = AuditRecord(
            observed_at=approval.decided_at, stage=STAGE, run_id=pending.run_id,
            attempt_id=pending.attempt_id, response_id=pending.response_id, item_id=pending.item_id,
            call_id=pending.call_id, model_route=pending.route, stream_event=None,
            tool_name=self._tool_label(pending.tool_name), buffer_bytes=len(pending.arguments),
            terminal_seen=True, json_status="valid", trailing_data=False, schema_status="valid",
            policy_status=policy_status, execution_state=None, state=state.value,
            error_class=reason.value if reason else None,
            extra={"approval": approval.decision, "approval_rule": pending.why},
            content_hmac=self._content_hmac(pending.arguments),
        )
        return Output(self.topics.audit, pending.run_id.encode(), encode(record))

    def _undecodable(self, record: ConsumerRecord, exc: RecordError) -> list[Output]:
        run_id = _safe_key(record.key)
        if self.live:
            metrics.record_decision(STAGE, ItemState.REJECTED, exc.reason)
        log.warning("undecodable record parked", stage=STAGE, topic=record.topic,
                    partition=record.partition, offset=record.offset, reason=exc.reason.value)
        dead = DeadLetter(
            stage=STAGE, state=ItemState.REJECTED.value, reason=exc.reason.value, run_id=run_id,
            attempt_id="", response_id=None, item_id=None, call_id=None, route="", tool_category=None,
            byte_count=len(record.value or b""), last_provider_event=None, observed_at=record.timestamp,
            detail_code=f"{record.topic}[{record.partition}]@{record.offset}",
        )
        return [Output(self.topics.dlq, record.key, encode(dead))]

    def _evict(self) -> None:
        cutoff = self.stream_time_ms - self.run_state_ttl_ms
        for run_id in [r for r, run in self.runs.items() if run.last_seen_ms < cutoff]:
            del self.runs[run_id]
        self.join.evict_orphans(self.stream_time_ms)


def _safe_key(key: bytes | None) -> str:
    if not key:
        return "unknown"
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown"
    return text if len(text) <= 128 and text.isprintable() else "unknown"


def make_factory(
    validator: Validator, topics: TopicNames, signing_key: bytes, key_id: str, run_state_ttl_ms: int,
    content_key: bytes | None = None,
):
    async def factory(
        partition: int, committed: dict[TopicPartition, OffsetAndMetadata], reader: PartitionReader
    ) -> ValidatorProcessor:
        processor = ValidatorProcessor(validator, topics, signing_key, key_id, run_state_ttl_ms,
                                       content_key=content_key)
        metadata = _parse_metadata(committed)
        streams = []
        for tp, position in committed.items():
            start = metadata.get(tp.topic, position.offset)
            if start < position.offset:
                streams.append(await reader.read(tp, start, position.offset))
            processor.next_offsets[tp.topic] = position.offset
        replayed = list(heapq.merge(*streams, key=lambda r: r.timestamp))
        processor.replay(replayed)
        for tp, position in committed.items():
            processor.next_offsets[tp.topic] = position.offset
        log.info("validator partition restored", stage=STAGE, partition=partition, records=len(replayed),
                 count=len(processor.join.open))
        return processor

    return factory


def _parse_metadata(committed: dict[TopicPartition, OffsetAndMetadata]) -> dict[str, int]:
    for position in committed.values():
        try:
            data = json.loads(position.metadata)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("v") == METADATA_VERSION and isinstance(data.get("replay"), dict):
            return {str(k): int(v) for k, v in data["replay"].items()}
    return {}


def build_validator(settings: Settings) -> Validator:
    return Validator(
        ToolRegistry.load_dir(settings.tools_dir),
        PolicySet.load(settings.policies_dir),
        approval_ttl_ms=settings.approval_ttl_s * 1000,
    )


async def run_validator(settings: Settings, stop: asyncio.Event, *, group_id: str | None = None) -> None:
    topics = settings.topics
    group_id = group_id or f"{topics.namespace}-validator"  # one group per topic namespace
    factory = make_factory(
        build_validator(settings), topics, settings.signing_key(), settings.signing_key_id,
        settings.run_state_ttl_s * 1000,
        content_key=settings.audit_hmac_key.get_secret_value().encode() if settings.audit_hmac_key else None,
    )
    port = metrics.start_metrics(settings, STAGE)
    try:
        await run_transactional_stage(
            stop,
            bootstrap=settings.kafka_bootstrap,
            group_id=group_id,
            input_topics=[topics.items, topics.calls_pending, topics.approvals],
            factory=factory,
            transactional_prefix=f"{topics.namespace}-validator",
            metrics_stage=STAGE,
        )
    finally:
        metrics.stop_metrics(port)


def main(settings: Settings | None = None) -> int:
    configure_logging()  # also routes aiokafka's stdlib logging through the allowlist
    settings = settings or Settings.from_env()

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("validator starting", stage=STAGE, worker_id=settings.worker_id)
        await run_validator(settings, stop)

    asyncio.run(_run())
    return 0
