"""The executor worker: a thin async shell around the ledger, the tools and reconcile.

One consumer in group `<namespace>.executor` reads `calls.approved`
(read_committed). Each owned partition p gets its own transactional producer
(`<namespace>.executor-p`), created *before* anything else so that it fences a
previous owner still running (aiokafka has no KIP-447), and then the ledger
partition p is read to its end. The ledger is co-partitioned with the approved
topic: the entry for a call read from approved partition p is written to
ledger partition p (key: call id, so compaction keeps the last entry per call).

Per approved record, in partition order (so the calls of one run execute one
at a time, in the order the validator approved them):

1. decode; verify the signature (forged/altered -> dead letter, never run);
2. decide against the ledger view:
   Skip      -> commit the input offset, publish nothing (already published);
   Reconcile -> per-tool reconcile, publish its verdict, settle the ledger;
   Run       -> transaction A: the STARTED entry, committed (acks=all) before
                the tool is invoked; run the tool; transaction B: result,
                audit, FINISHED entry and the input offset, atomically.
A crash between A and B leaves STARTED without FINISHED and an uncommitted
input offset: the redelivery is reconciled, never re-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import ProducerFenced

from callgate import avro, metrics
from callgate.errors import CallgateError, ExecutionError, Reason, RecordError
from callgate.kafka import make_consumer, make_producer
from callgate.logging import get_logger
from callgate.records import ApprovedCall, AuditRecord, DeadLetter, LedgerEntry, ToolResult
from callgate.signing import verify
from callgate.states import ItemState
from callgate.topics import TopicNames
from executor import ledger
from executor.ledger import LedgerView, Reconcile, Run, Skip, decide
from executor.reconcile import reconcile
from executor.tools import Limits, ToolContext, ToolOutcome, parse_arguments, run_tool

log = get_logger("callgate.executor")
STAGE = "executor"


def now_ms() -> int:
    return int(time.time() * 1000)


ContextFor = Callable[[ApprovedCall], ToolContext]


@dataclass(slots=True)
class ExecutorConfig:
    bootstrap: str
    topics: TopicNames
    signing_keys: dict[str, bytes]
    digest_key: bytes  # keys the ledger's intent digests
    executor_id: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    context_for: ContextFor | None = None  # workspace + policy facts for a call; default: no http hosts
    limits: Limits = field(default_factory=Limits)
    max_poll_interval_ms: int = 900_000  # longer than the longest tool run
    # Static membership (KIP-345): a restarted instance with the same id takes its
    # partitions back at once instead of waiting for the dead member's session to expire.
    instance_id: str | None = None
    session_timeout_ms: int = 10_000
    metrics_port: int | None = None  # serve /metrics on 127.0.0.1 (0: any free port)

    @property
    def group_id(self) -> str:
        return f"{self.topics.namespace}.executor"


@dataclass(frozen=True, slots=True)
class _Out:
    topic: str
    key: bytes
    value: bytes
    partition: int | None = None


@dataclass(slots=True)
class _Owned:
    producer: AIOKafkaProducer
    view: LedgerView
    position: int  # next approved offset to process


class _Listener(ConsumerRebalanceListener):
    def __init__(self, worker: ExecutorWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._worker._release({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._worker._acquire(sorted({tp.partition for tp in assigned}))


async def restore_ledger(bootstrap: str, topic: str, partition: int) -> LedgerView:
    """Fold one ledger partition, read committed, up to its end as of now."""
    view = LedgerView()
    tp = TopicPartition(topic, partition)
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=500, max_records=5000)
            for record in batch.get(tp, []):
                try:
                    entry = avro.decode(record.value, topic=topic, partition=partition, offset=record.offset)
                except RecordError:
                    log.error("ledger entry undecodable", topic=topic, partition=partition, offset=record.offset)
                    continue
                if isinstance(entry, LedgerEntry):
                    view.apply(entry)
    finally:
        await consumer.stop()
    return view


class ExecutorWorker:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.topics = config.topics
        self._owned: dict[int, _Owned] = {}
        self._lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None
        self.processed = 0
        self._lag = metrics.LagTracker(STAGE)

    # ------------------------------------------------------------ ownership

    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self.topics.calls_approved, partition)

    async def _acquire(self, partitions: list[int]) -> None:
        async with self._lock:
            # in parallel: each build is a fencing round trip plus a ledger read
            wanted = [p for p in partitions if p not in self._owned]
            outcomes = await asyncio.gather(*(self._build(p) for p in wanted), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def _build(self, partition: int) -> None:
        assert self._consumer is not None
        # Fence first: after this, no previous owner can commit a STARTED we would miss.
        producer = await make_producer(
            self.config.bootstrap, transactional_id=f"{self.config.group_id}-{partition}"
        )
        try:
            view = await restore_ledger(self.config.bootstrap, self.topics.ledger, partition)
            tp = self._tp(partition)
            committed = await self._consumer.committed(tp)
            if committed is None or committed < 0:
                await self._consumer.seek_to_beginning(tp)
                position = 0
            else:
                self._consumer.seek(tp, committed)
                position = committed
        except BaseException:
            await producer.stop()
            raise
        self._owned[partition] = _Owned(producer, view, position)
        log.info("partition acquired", stage=STAGE, partition=partition, count=len(view))

    async def _release(self, partitions: set[int]) -> None:
        async with self._lock:
            for partition in partitions:
                owned = self._owned.pop(partition, None)
                if owned is not None:
                    with contextlib.suppress(Exception):
                        await owned.producer.stop()

    async def _rebuild(self, partition: int, exc: BaseException) -> None:
        log.warning("partition failed; rebuilding from the ledger", stage=STAGE, partition=partition,
                    error_class=type(exc).__name__)
        owned = self._owned.pop(partition, None)
        if owned is not None:
            with contextlib.suppress(Exception):
                await owned.producer.stop()
        if self._consumer is not None and self._tp(partition) in self._consumer.assignment():
            await self._build(partition)

    # ------------------------------------------------------------ transactions

    async def _commit(self, partition: int, outputs: list[_Out], next_offset: int | None) -> None:
        owned = self._owned[partition]
        producer = owned.producer
        await producer.begin_transaction()
        try:
            if next_offset is not None:
                await producer.send_offsets_to_transaction({self._tp(partition): next_offset}, self.config.group_id)
            futures = [
                await producer.send(o.topic, o.value, key=o.key, partition=o.partition) for o in outputs
            ]
            await producer.commit_transaction()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.abort_transaction()
            raise
        for future in futures:
            future.result()
        if next_offset is not None:
            owned.position = next_offset
        for o in outputs:
            if o.topic == self.topics.ledger:
                owned.view.apply(avro.decode(o.value))

    async def _commit_final(self, partition: int, outputs: list[_Out], next_offset: int) -> None:
        """The tool already ran: retry transient failures before giving up (which means IN_DOUBT)."""
        for attempt in range(3):
            try:
                await self._commit(partition, outputs, next_offset)
                return
            except ProducerFenced:
                raise
            except Exception:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))  # backoff before retrying the broker

    # ------------------------------------------------------------ records

    def _ledger_out(self, entry: LedgerEntry, partition: int) -> _Out:
        return _Out(self.topics.ledger, entry.call_id.encode(), avro.encode(entry), partition)

    def _context(self, call: ApprovedCall) -> ToolContext:
        if self.config.context_for is not None:
            return self.config.context_for(call)
        return ToolContext(call.workspace, frozenset(), self.config.limits)

    async def _process(self, partition: int, record: ConsumerRecord) -> None:
        next_offset = record.offset + 1
        try:
            call = avro.decode(record.value, topic=record.topic, partition=partition, offset=record.offset)
            if not isinstance(call, ApprovedCall):
                raise RecordError(Reason.UNKNOWN_SCHEMA, "not an approved call", topic=record.topic,
                                  partition=partition, offset=record.offset)
        except RecordError as exc:
            log.error("approved record undecodable", stage=STAGE, partition=partition, offset=record.offset,
                      reason=exc.reason.value)
            await self._commit(partition, [self._dead_letter_undecodable(record, exc.reason)], next_offset)
            metrics.record_decision(STAGE, ItemState.REJECTED, Reason.RECORD_UNDECODABLE)
            return
        try:
            verify(call, self.config.signing_keys)
        except ExecutionError as exc:
            log.warning("approved call refused", stage=STAGE, call_id=call.call_id, run_id=call.run_id,
                        reason=exc.reason.value)
            outs = [self._dead_letter(call, ItemState.REJECTED, exc.reason),
                    self._audit(call, ItemState.REJECTED, exc.reason.value, decision="refused")]
            await self._commit(partition, outs, next_offset)
            metrics.record_decision(STAGE, ItemState.REJECTED, exc.reason)
            return
        decision = decide(call.call_id, self._owned[partition].view)
        if isinstance(decision, Skip):
            log.info("duplicate delivery skipped", stage=STAGE, call_id=call.call_id, phase=decision.entry.phase)
            await self._commit(partition, [], next_offset)
        elif isinstance(decision, Reconcile):
            await self._reconcile(partition, call, decision.entry, next_offset)
        else:
            assert isinstance(decision, Run)
            await self._run(partition, call, next_offset)

    async def _run(self, partition: int, call: ApprovedCall, next_offset: int) -> None:
        try:
            args = parse_arguments(call.arguments)
            ctx = self._context(call)
        except CallgateError as exc:
            args, ctx, refusal = None, None, exc.reason
        else:
            refusal = None
        digest = ledger.intent_digest(call.tool_name, args, self.config.digest_key) if args else None
        start = ledger.started(call_id=call.call_id, run_id=call.run_id, tool_name=call.tool_name,
                               now_ms=now_ms(), executor_id=self.config.executor_id, digest=digest)
        started_at = start.updated_at
        if refusal is not None or ctx is None:
            outcome = ToolOutcome(ItemState.FAILED, error_class=(refusal or Reason.TOOL_FAILED).value)
            duration = 0
        else:
            # The decision is durable (acks=all, committed) before the side effect.
            await self._commit(partition, [self._ledger_out(start, partition)], None)
            t0 = time.monotonic()
            outcome = await asyncio.to_thread(run_tool, call.tool_name, call.arguments, ctx)
            duration = int((time.monotonic() - t0) * 1000)
        finished_at = now_ms()
        result = ToolResult(
            call_id=call.call_id, run_id=call.run_id, item_id=call.item_id, tool_name=call.tool_name,
            state=outcome.state.value, started_at=started_at, finished_at=finished_at, duration_ms=duration,
            output=outcome.output, output_bytes=outcome.output_bytes, truncated=outcome.truncated,
            exit_code=outcome.exit_code, error_class=outcome.error_class,
        )
        final = ledger.settled(start, outcome.state, now_ms=finished_at, executor_id=self.config.executor_id)
        outs = [
            _Out(self.topics.results, call.run_id.encode(), avro.encode(result)),
            self._audit(call, outcome.state, outcome.error_class, decision="run", result=result),
            self._ledger_out(final, partition),
        ]
        await self._commit_final(partition, outs, next_offset)
        metrics.record_decision(STAGE, outcome.state, outcome.error_class)
        metrics.observe_decision_latency(STAGE, call.approved_at, finished_at)
        log.info("call executed", stage=STAGE, call_id=call.call_id, run_id=call.run_id, tool=call.tool_name,
                 state=outcome.state.value, error_class=outcome.error_class, duration_ms=duration,
                 bytes=outcome.output_bytes)

    async def _reconcile(self, partition: int, call: ApprovedCall, entry: LedgerEntry, next_offset: int) -> None:
        try:
            args = parse_arguments(call.arguments)
        except CallgateError:
            args = {}
        verdict = await asyncio.to_thread(
            reconcile, call.tool_name, args, entry, workspace=call.workspace, digest_key=self.config.digest_key
        )
        finished_at = now_ms()
        reason = verdict.reason.value if verdict.reason else None
        result = ToolResult(
            call_id=call.call_id, run_id=call.run_id, item_id=call.item_id, tool_name=call.tool_name,
            state=verdict.state.value, started_at=entry.updated_at, finished_at=finished_at,
            duration_ms=max(0, finished_at - entry.updated_at), output=verdict.output,
            output_bytes=len(verdict.output), truncated=False, exit_code=None, error_class=reason,
        )
        final = ledger.settled(entry, verdict.state, now_ms=finished_at, executor_id=self.config.executor_id)
        outs = [
            _Out(self.topics.results, call.run_id.encode(), avro.encode(result)),
            self._audit(call, verdict.state, reason, decision="reconcile", result=result),
            self._ledger_out(final, partition),
        ]
        if verdict.escalate:
            outs.append(self._dead_letter(call, verdict.state, verdict.reason or Reason.IN_DOUBT))
        await self._commit_final(partition, outs, next_offset)
        metrics.record_decision(STAGE, verdict.state, reason)
        metrics.observe_decision_latency(STAGE, call.approved_at, finished_at)
        log.warning("call reconciled", stage=STAGE, call_id=call.call_id, run_id=call.run_id,
                    tool=call.tool_name, state=verdict.state.value, reason=reason)

    def _audit(self, call: ApprovedCall, state: ItemState, error_class: str | None, *, decision: str,
               result: ToolResult | None = None) -> _Out:
        extra = {"decision": decision, "policy_version": call.policy_version}
        if result is not None:
            extra.update(output_bytes=str(result.output_bytes), duration_ms=str(result.duration_ms),
                         truncated=str(result.truncated).lower())
            if result.exit_code is not None:
                extra["exit_code"] = str(result.exit_code)
        record = AuditRecord(
            observed_at=now_ms(), stage=STAGE, run_id=call.run_id, attempt_id=call.attempt_id,
            response_id=call.response_id, item_id=call.item_id, call_id=call.call_id, model_route=call.route,
            stream_event=None, tool_name=call.tool_name, buffer_bytes=len(call.arguments), terminal_seen=True,
            json_status="valid", trailing_data=False, schema_status="valid", policy_status="approved",
            execution_state=state.value, state=state.value, error_class=error_class, extra=extra,
        )
        return _Out(self.topics.audit, call.run_id.encode(), avro.encode(record))

    def _dead_letter(self, call: ApprovedCall, state: ItemState, reason: Reason) -> _Out:
        record = DeadLetter(
            stage=STAGE, state=state.value, reason=reason.value, run_id=call.run_id, attempt_id=call.attempt_id,
            response_id=call.response_id, item_id=call.item_id, call_id=call.call_id, route=call.route,
            tool_category=call.tool_name, byte_count=len(call.arguments), last_provider_event=None,
            observed_at=now_ms(),
        )
        return _Out(self.topics.dlq, call.run_id.encode(), avro.encode(record))

    def _dead_letter_undecodable(self, record: ConsumerRecord, reason: Reason) -> _Out:
        dead = DeadLetter(
            stage=STAGE, state=ItemState.REJECTED.value, reason=Reason.RECORD_UNDECODABLE.value,
            run_id=(record.key or b"").decode("utf-8", "replace")[:128], attempt_id="", response_id=None,
            item_id=None, call_id=None, route="", tool_category=None, byte_count=len(record.value or b""),
            last_provider_event=None, observed_at=now_ms(), detail_code=reason.value,
        )
        return _Out(self.topics.dlq, record.key or b"", avro.encode(dead))

    # ------------------------------------------------------------ loop

    async def _check_copartitioned(self, consumer: AIOKafkaConsumer) -> None:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - fresh counts for a startup check
        approved = consumer.partitions_for_topic(self.topics.calls_approved) or set()
        ledger_parts = consumer.partitions_for_topic(self.topics.ledger) or set()
        if not approved or approved != ledger_parts:
            # a deployment error, not an item outcome: refuse to start rather than mis-partition the ledger
            raise RuntimeError("the ledger and approved topics must exist with equal partition counts")

    async def run(self, stop: asyncio.Event) -> None:
        self._consumer = consumer = AIOKafkaConsumer(
            bootstrap_servers=self.config.bootstrap,
            group_id=self.config.group_id,
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_poll_interval_ms=self.config.max_poll_interval_ms,
            group_instance_id=self.config.instance_id,
            session_timeout_ms=self.config.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.config.session_timeout_ms // 4),
        )
        await consumer.start()
        port = metrics.start_metrics(self.config, STAGE)
        try:
            await self._check_copartitioned(consumer)
            consumer.subscribe([self.topics.calls_approved], listener=_Listener(self))
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=200, max_records=50)
                async with self._lock:
                    for tp, records in batches.items():
                        await self._handle_partition(tp.partition, records)
                    await self._lag.update(consumer, [self._tp(p) for p in self._owned])
        finally:
            await self._release(set(self._owned))
            self._lag.clear()
            metrics.stop_metrics(port)
            await consumer.stop()

    async def _handle_partition(self, partition: int, records: list[ConsumerRecord]) -> None:
        for record in records:
            owned = self._owned.get(partition)
            if owned is None:
                return  # revoked; the new owner reads these again
            if record.offset < owned.position:
                continue  # fetched from a position set before we fenced the previous owner
            try:
                await self._process(partition, record)
            except Exception as exc:  # noqa: BLE001 - any failure: rebuild from the durable ledger
                await self._rebuild(partition, exc)
                return
            self.processed += 1
            metrics.record_event(STAGE)
