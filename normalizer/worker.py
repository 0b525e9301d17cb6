"""The normalizer worker: `callgate.sse.raw` in; items, dlq, audit (and quarantine) out.

A consumer group on sse.raw through callgate.kafka's transactional stage:
per input partition one processor holding a `Normalizer` (the pure core),
whose outputs go out in the same Kafka transaction as the input offsets:
TerminalItem -> items, DeadLetter -> dlq, AuditRecord -> audit, and, only
when CALLGATE_DATA_HANDLING=keep, QuarantinedBuffer -> quarantine
(restricted). Everything is keyed by run id.

State recovery: deterministic replay, no changelog. The only state is the
open attempts (their adapters, items and buffers). Every commit stores, in
the offset metadata, `replay_from`: the offset of the AttemptStarted of the
oldest attempt still open (or the next offset when none is). A new owner
re-reads [replay_from, committed) and feeds it to a fresh core, discarding
what that replay outputs (it committed already). Because the core takes
every timestamp it writes from the records and keeps no state for attempts
it never saw start, the rebuilt state equals the lost one: an attempt that
ended before replay_from is absent in both; one open at the commit started
at or after replay_from and is replayed whole. Call ids are fresh random
values; only items still open are re-keyed, and none of those was written.

Idle deadline under replay: tick() never quarantines anything itself. When
this processor has consumed nothing of an open attempt for the deadline
(its own wall clock, counted from when it last fed one of the run's records,
or from its own start for replayed runs, so a worker coming back after
downtime does not condemn every open run at once), it writes a TransportEnd
with reason `run_idle_deadline` to sse.raw, keyed by the run id (so it lands
on the same partition), in a transaction. The quarantine happens when that
marker is consumed, as ordinary input: a rebuilt processor replays it, and a
second marker (a rebuilt processor may send one) finds no open attempt, or a
newer attempt, and is silent.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord, TopicPartition

from callgate import metrics
from callgate.avro import decode, encode
from callgate.errors import Reason, RecordError
from callgate.kafka import OffsetAndMetadata, Output, PartitionReader, run_transactional_stage
from callgate.logging import configure_logging, get_logger
from callgate.records import (
    AttemptStarted, AuditRecord, DeadLetter, QuarantinedBuffer, RawSseMessage, TerminalItem, TransportEnd,
)
from callgate.settings import DataHandling, Settings
from callgate.states import ItemState
from callgate.topics import TopicNames

from normalizer.accumulator import IDLE_MARKER_REASON, STAGE, Limits, Normalizer

log = get_logger("callgate.normalizer")
METADATA_VERSION = 1
INPUT_TYPES = (AttemptStarted, RawSseMessage, TransportEnd)


@dataclass(slots=True)
class NormalizerProcessor:
    topics: TopicNames
    limits: Limits
    keep_raw: bool = False
    core: Normalizer = field(init=False)
    next_offset: int = 0
    markers_sent: set[tuple[str, str]] = field(default_factory=set)
    fed_at: dict[str, int] = field(default_factory=dict)  # run id -> wall ms when we last fed one of its records
    started_ms: int = field(default_factory=lambda: _wall_ms())
    live: bool = True  # False while replaying: no metrics for outputs that committed already

    def __post_init__(self) -> None:
        self.core = Normalizer(limits=self.limits, keep_raw=self.keep_raw)

    # ------------------------------------------------------------ protocol

    def process(self, records: list[ConsumerRecord]) -> list[Output]:
        outputs: list[Output] = []
        for record in records:
            outputs.extend(self._one(record))
        return outputs

    def replay(self, records: Iterable[ConsumerRecord]) -> None:
        self.live = False
        try:
            for record in records:
                self._one(record)
        finally:
            self.live = True

    def tick(self, now_ms: int) -> list[Output]:
        outputs = []
        for run_id in [r for r in self.fed_at if r not in self.core.runs]:
            del self.fed_at[run_id]
        for run_id, run in self.core.runs.items():
            attempt = run.attempt
            if attempt is None or (run_id, attempt.attempt_id) in self.markers_sent:
                continue
            quiet_since = max(self.fed_at.get(run_id, self.started_ms), self.started_ms)
            if now_ms - quiet_since < self.limits.idle_deadline_ms:
                continue
            self.markers_sent.add((run_id, attempt.attempt_id))
            # ended_at: the last record's own time plus the deadline, not our clock, so the
            # quarantine record says when the run's silence became final in the run's own terms
            marker = TransportEnd(
                run_id=run_id, attempt_id=attempt.attempt_id, seq=-1, route=attempt.record.route,
                reason=IDLE_MARKER_REASON, ended_at=attempt.last_activity_ms + self.limits.idle_deadline_ms,
                bytes_received=0, messages=0,
            )
            outputs.append(Output(self.topics.sse_raw, run_id.encode(), encode(marker)))
            log.info("run idle past its deadline; marker written", stage=STAGE, run_id=run_id,
                     attempt_id=attempt.attempt_id)
        return outputs

    def commit_metadata(self) -> str:
        return json.dumps({"v": METADATA_VERSION, "replay_from": self.core.replay_from(self.next_offset)},
                          separators=(",", ":"))

    # ------------------------------------------------------------ records

    def _one(self, record: ConsumerRecord) -> list[Output]:
        self.next_offset = record.offset + 1
        if self.live:
            metrics.EVENTS_IN.labels(stage=STAGE).inc()
        try:
            value = decode(record.value, topic=record.topic, partition=record.partition, offset=record.offset)
        except RecordError as exc:
            return self._parked(record, exc.reason)
        if not isinstance(value, INPUT_TYPES):
            return self._parked(record, Reason.UNKNOWN_SCHEMA)
        if isinstance(value, TransportEnd):
            self.markers_sent.discard((value.run_id, value.attempt_id))
        self.fed_at[value.run_id] = _wall_ms()
        return [self._output(out) for out in self.core.feed(value, record.offset)]

    def _output(self, out) -> Output:
        t = self.topics
        if isinstance(out, TerminalItem):
            topic = t.items
            if self.live:
                metrics.record_decision(STAGE, ItemState.ITEM_TERMINAL.value, None)
        elif isinstance(out, DeadLetter):
            topic = t.dlq
            if self.live:
                metrics.record_decision(STAGE, out.state, out.reason)
                log.info("item quarantined" if out.call_id else "stream anomaly", stage=STAGE, run_id=out.run_id,
                         attempt_id=out.attempt_id, item_id=out.item_id, call_id=out.call_id, reason=out.reason,
                         detail_code=out.detail_code, bytes=out.byte_count)
        elif isinstance(out, AuditRecord):
            topic = t.audit
            if self.live and out.extra.get("kind") == "attempt_summary" and out.extra.get("unknown_events"):
                metrics.UNKNOWN_EVENTS.labels(route=_route_label(out.model_route)).inc(
                    int(out.extra["unknown_events"]))
        else:
            assert isinstance(out, QuarantinedBuffer)
            topic = t.quarantine
        return Output(topic, out.run_id.encode(), encode(out))

    def _parked(self, record: ConsumerRecord, reason: Reason) -> list[Output]:
        run_id = _safe_key(record.key)
        if self.live:
            log.warning("undecodable record parked", stage=STAGE, topic=record.topic, partition=record.partition,
                        offset=record.offset, reason=reason.value)
        dead = DeadLetter(
            stage=STAGE, state=ItemState.QUARANTINED.value, reason=reason.value, run_id=run_id, attempt_id="",
            response_id=None, item_id=None, call_id=None, route="", tool_category=None,
            byte_count=len(record.value or b""), last_provider_event=None, observed_at=record.timestamp,
            detail_code=f"{record.topic}[{record.partition}]@{record.offset}",
        )
        return [Output(self.topics.dlq, record.key, encode(dead))]


def _wall_ms() -> int:
    return int(time.time() * 1000)


def _route_label(route: str) -> str:
    from normalizer.adapters import ROUTES

    return route if route in ROUTES else "unknown"


def _safe_key(key: bytes | None) -> str:
    if not key:
        return "unknown"
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown"
    return text if len(text) <= 128 and text.isprintable() else "unknown"


def _replay_from(committed: OffsetAndMetadata) -> int:
    try:
        data = json.loads(committed.metadata)
    except ValueError:
        return committed.offset
    if isinstance(data, dict) and data.get("v") == METADATA_VERSION and isinstance(data.get("replay_from"), int):
        return min(data["replay_from"], committed.offset)
    return committed.offset


def make_factory(topics: TopicNames, limits: Limits, keep_raw: bool):
    async def factory(
        partition: int, committed: dict[TopicPartition, OffsetAndMetadata], reader: PartitionReader
    ) -> NormalizerProcessor:
        processor = NormalizerProcessor(topics, limits, keep_raw)
        replayed = 0
        for tp, position in committed.items():
            start = _replay_from(position)
            if start < position.offset:
                records = await reader.read(tp, start, position.offset)
                processor.replay(records)
                replayed += len(records)
            processor.next_offset = position.offset
        log.info("normalizer partition restored", stage=STAGE, partition=partition, records=replayed,
                 count=len(processor.core.runs))
        return processor

    return factory


def limits_from(settings: Settings) -> Limits:
    return Limits(max_item_bytes=settings.max_item_bytes, idle_deadline_ms=int(settings.run_idle_deadline_s * 1000))


async def run_normalizer(settings: Settings, stop: asyncio.Event, *, group_id: str | None = None, **options) -> None:
    topics = settings.topics
    await run_transactional_stage(
        stop,
        bootstrap=settings.kafka_bootstrap,
        group_id=group_id or f"{topics.namespace}-normalizer",
        input_topics=[topics.sse_raw],
        factory=make_factory(topics, limits_from(settings), settings.data_handling is DataHandling.KEEP),
        transactional_prefix=f"{topics.namespace}-normalizer",
        **options,
    )


def main(settings: Settings | None = None) -> int:
    configure_logging()  # also routes aiokafka's stdlib logging through the allowlist
    settings = settings or Settings.from_env()

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        port = metrics.start_metrics(settings, STAGE)
        log.info("normalizer starting", stage=STAGE, worker_id=settings.worker_id)
        try:
            await run_normalizer(settings, stop)
        finally:
            metrics.stop_metrics(port)

    asyncio.run(_run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
