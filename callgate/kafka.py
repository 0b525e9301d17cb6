"""Kafka wiring shared by the stages: clients, topics, and the transactional loop.

Producers are idempotent with acks=all; consumers read committed and never
auto-commit. Consume-transform-produce stages use `run_transactional_stage`:

* The unit of ownership is a *partition number* across all input topics (the
  stages' inputs are co-partitioned: every topic is keyed by run id and has the
  same partition count, and the range assignor hands partition p of every input
  topic to the same member). So the validator sees a run's items and its
  approvals in one place.
* Each owned partition number gets its own transactional producer,
  `transactional_id = f"{prefix}-{group}-{p}"`. aiokafka has no KIP-447
  group metadata, so this per-partition id is what fences a zombie: when a new
  owner initialises the same id, the broker aborts the old owner's open
  transaction and refuses its later writes (the pre-2.5 scheme faust uses).
* Per partition the stage supplies a processor, built by an async factory
  *after* the producer has fenced the previous owner, from the committed input
  offsets and the metadata string stored with them:

      async def factory(partition: int, committed: dict[TopicPartition, Committed],
                        reader: PartitionReader) -> Processor

  `reader.read(tp, start, end)` re-reads committed input records, which lets a
  processor rebuild state by deterministic replay from an offset it remembered
  in its metadata. The processor is pure:

      process(records: list[ConsumerRecord]) -> list[Output]   # one partition, any input topic
      tick(now_ms: int) -> list[Output]                        # time-driven outputs
      commit_metadata() -> str                                 # stored with the committed offsets

* Per batch: begin, send the input offsets (before the records, which sidesteps
  aiokafka #1004), send the outputs, commit. If anything fails the transaction
  is aborted, the processor is discarded and rebuilt from the committed offsets:
  nothing is half-applied, so read_committed readers see every input's outputs
  exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import TopicAlreadyExistsError

from callgate.logging import get_logger
from callgate.topics import TopicNames

log = get_logger("callgate.kafka")


class TopicMissing(LookupError):
    """The topic does not exist (run `callgate topics create`)."""


@dataclass(frozen=True, slots=True)
class Output:
    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class Committed:
    offset: int  # next offset to read
    metadata: str


class Processor(Protocol):
    def process(self, records: list[ConsumerRecord]) -> list[Output]: ...

    def tick(self, now_ms: int) -> list[Output]: ...

    def commit_metadata(self) -> str: ...


ProcessorFactory = Callable[[int, dict[TopicPartition, Committed], "PartitionReader"], Awaitable[Processor]]


async def make_producer(bootstrap: str, *, transactional_id: str | None = None, **kw: Any) -> AIOKafkaProducer:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        acks="all",
        transactional_id=transactional_id,
        **kw,
    )
    await producer.start()
    return producer


async def make_consumer(bootstrap: str, *topics: str, group_id: str | None, **kw: Any) -> AIOKafkaConsumer:
    kw.setdefault("auto_offset_reset", "earliest")
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=group_id,
        isolation_level="read_committed",
        enable_auto_commit=False,
        **kw,
    )
    await consumer.start()
    return consumer


async def create_topics(bootstrap: str, names: TopicNames, partitions: int = 6) -> list[str]:
    """Create every topic of the design; existing ones are left alone. Returns the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [spec for spec in names.specs() if spec.name not in existing]
        new = [
            NewTopic(
                spec.name,
                num_partitions=partitions,
                replication_factor=1,
                topic_configs={
                    "cleanup.policy": "compact" if spec.compacted else "delete",
                    "retention.ms": str(spec.retention_ms),
                },
            )
            for spec in wanted
        ]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # a concurrent creator won the race; the topics exist, which is all we need
        return [spec.name for spec in wanted]
    finally:
        await admin.close()


class PartitionReader:
    """Re-reads committed records of an input partition, for state recovery by replay."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap

    async def read(self, tp: TopicPartition, start: int, end: int) -> list[ConsumerRecord]:
        if end <= start:
            return []
        consumer = await make_consumer(self._bootstrap, group_id=None)
        try:
            consumer.assign([tp])
            consumer.seek(tp, start)
            records: list[ConsumerRecord] = []
            while True:
                if await consumer.position(tp) >= end:
                    break
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=2000)
                for record in batch.get(tp, []):
                    if record.offset >= end:
                        break
                    records.append(record)
                # transaction markers take offsets too: a position past end means done
            return records
        finally:
            await consumer.stop()


@dataclass(slots=True)
class _Owned:
    producer: AIOKafkaProducer
    processor: Processor
    positions: dict[TopicPartition, int] = field(default_factory=dict)  # next offset per input tp


class _Listener(ConsumerRebalanceListener):
    def __init__(self, stage: TransactionalStage) -> None:
        self._stage = stage

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._stage._release({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._stage._acquire(sorted({tp.partition for tp in assigned}))


class TransactionalStage:
    """The consume-transform-produce loop; see the module docstring."""

    def __init__(
        self,
        *,
        bootstrap: str,
        group_id: str,
        input_topics: Sequence[str],
        factory: ProcessorFactory,
        transactional_prefix: str = "callgate",
        max_records: int = 500,
        tick_interval_ms: int = 200,
        on_batch: Callable[[int, int], None] | None = None,
        consumer_options: dict[str, Any] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.input_topics = tuple(input_topics)
        self.factory = factory
        self.prefix = transactional_prefix
        self.max_records = max_records
        self.tick_interval_ms = tick_interval_ms
        self.on_batch = on_batch
        self.consumer_options = consumer_options or {}
        self._owned: dict[int, _Owned] = {}
        self._lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None
        self._reader = PartitionReader(bootstrap)
        self.commits = 0

    def _input_tps(self, partition: int) -> list[TopicPartition]:
        assert self._consumer is not None
        return [tp for tp in self._consumer.assignment() if tp.partition == partition]

    async def _committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, Committed]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(self.group_id, partitions=tps)
        finally:
            await admin.close()
        return {
            tp: Committed(meta.offset, meta.metadata or "")
            for tp, meta in offsets.items()
            if meta.offset is not None and meta.offset >= 0
        }

    async def _build(self, partition: int, producer: AIOKafkaProducer) -> _Owned:
        """Fence, then build the processor from the committed offsets and seek there."""
        assert self._consumer is not None
        tps = self._input_tps(partition)
        committed = await self._committed(tps)
        processor = await self.factory(partition, committed, self._reader)
        owned = _Owned(producer=producer, processor=processor)
        for tp in tps:
            if tp in committed:
                self._consumer.seek(tp, committed[tp].offset)
                owned.positions[tp] = committed[tp].offset
            else:
                await self._consumer.seek_to_beginning(tp)
        return owned

    async def _acquire(self, partitions: list[int]) -> None:
        async with self._lock:
            for partition in partitions:
                if partition in self._owned:
                    continue
                producer = await make_producer(
                    self.bootstrap, transactional_id=f"{self.prefix}-{self.group_id}-{partition}"
                )
                try:
                    self._owned[partition] = await self._build(partition, producer)
                except BaseException:
                    await producer.stop()
                    raise
                log.info("partition acquired", stage=self.group_id, partition=partition)

    async def _release(self, partitions: set[int]) -> None:
        async with self._lock:
            for partition in partitions:
                owned = self._owned.pop(partition, None)
                if owned is not None:
                    with contextlib.suppress(Exception):
                        await owned.producer.stop()
                    log.info("partition released", stage=self.group_id, partition=partition)

    async def _commit(
        self, partition: int, owned: _Owned, outputs: list[Output], advanced: dict[TopicPartition, int]
    ) -> None:
        positions = {**owned.positions, **advanced}
        producer = owned.producer
        await producer.begin_transaction()
        try:
            if positions:
                metadata = owned.processor.commit_metadata()
                await producer.send_offsets_to_transaction(
                    {tp: (offset, metadata) for tp, offset in positions.items()}, self.group_id
                )
            futures = [
                await producer.send(o.topic, o.value, key=o.key, headers=list(o.headers) or None)
                for o in outputs
            ]
            await producer.commit_transaction()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.abort_transaction()
            raise
        for future in futures:
            future.result()  # committed: every record was acknowledged
        owned.positions = positions
        self.commits += 1

    async def _recover(self, partition: int, exc: BaseException) -> None:
        """A failed transaction left the processor ahead of Kafka: rebuild it from what committed."""
        log.warning("transaction failed; rebuilding partition", stage=self.group_id,
                    partition=partition, error_class=type(exc).__name__)
        owned = self._owned.pop(partition, None)
        if owned is None:
            return
        with contextlib.suppress(Exception):
            await owned.producer.stop()
        # a fresh producer with the same id fences nothing new but resets our epoch
        producer = await make_producer(
            self.bootstrap, transactional_id=f"{self.prefix}-{self.group_id}-{partition}"
        )
        try:
            self._owned[partition] = await self._build(partition, producer)
        except BaseException:
            await producer.stop()
            raise

    async def _handle(self, batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        by_partition: dict[int, list[list[ConsumerRecord]]] = {}
        advanced: dict[int, dict[TopicPartition, int]] = {}
        for tp, records in batches.items():
            owned = self._owned.get(tp.partition)
            expected = owned.positions.get(tp) if owned is not None else None
            if expected is not None and records and records[0].offset < expected:
                # aiokafka may reset a position from a committed offset it fetched before we
                # fenced the previous owner; what we read after fencing is the truth
                records = [r for r in records if r.offset >= expected]
            if not records:
                continue
            by_partition.setdefault(tp.partition, []).append(records)
            advanced.setdefault(tp.partition, {})[tp] = records[-1].offset + 1
        for partition, per_topic in by_partition.items():
            owned = self._owned.get(partition)
            if owned is None:
                continue  # revoked while the fetch was in flight; the new owner reads it again
            # interleave input topics by time while keeping each partition's own order
            records = list(heapq.merge(*per_topic, key=lambda r: r.timestamp))
            try:
                outputs = owned.processor.process(records)
                await self._commit(partition, owned, outputs, advanced[partition])
            except Exception as exc:  # noqa: BLE001 - any failure means: rebuild from committed
                await self._recover(partition, exc)
                continue
            if self.on_batch is not None:
                self.on_batch(partition, len(records))

    async def _tick(self) -> None:
        now_ms = int(time.time() * 1000)
        for partition, owned in list(self._owned.items()):
            try:
                outputs = owned.processor.tick(now_ms)
                if outputs:
                    await self._commit(partition, owned, outputs, {})
            except Exception as exc:  # noqa: BLE001
                await self._recover(partition, exc)

    async def run(self, stop: asyncio.Event) -> None:
        self._consumer = consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            **self.consumer_options,
        )
        await consumer.start()
        consumer.subscribe(self.input_topics, listener=_Listener(self))
        last_tick = 0.0
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=self.tick_interval_ms, max_records=self.max_records)
                async with self._lock:
                    if batches:
                        await self._handle(batches)
                    if time.monotonic() - last_tick >= self.tick_interval_ms / 1000:
                        last_tick = time.monotonic()
                        await self._tick()
        finally:
            await self._release(set(self._owned))
            await consumer.stop()


async def run_transactional_stage(stop: asyncio.Event, **kw: Any) -> None:
    """Convenience wrapper: `await run_transactional_stage(stop, bootstrap=..., group_id=..., ...)`."""
    await TransactionalStage(**kw).run(stop)


async def read_topic(
    bootstrap: str,
    topic: str,
    *,
    until: Callable[[list[ConsumerRecord]], bool] | None = None,
    timeout_s: float = 30.0,
) -> list[ConsumerRecord]:
    """Read a topic from the beginning with read_committed.

    Without `until`, reads to the end offsets seen at the start. With it,
    reads until `until(records)` holds, raising TimeoutError at the deadline.
    """
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - topic just created
            partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            raise TopicMissing(topic)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps) if until is None else None
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if until is not None and until(records):
                return records
            if end is not None:
                positions = [await consumer.position(tp) for tp in tps]
                if all(pos >= end[tp] for pos, tp in zip(positions, tps, strict=True)):
                    return records
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: condition not met within {timeout_s}s ({len(records)} records)")
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                records.extend(messages)
    finally:
        await consumer.stop()


async def iter_topic(bootstrap: str, topic: str) -> AsyncIterator[ConsumerRecord]:
    """Follow a topic from the beginning forever (read_committed, no group)."""
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            raise TopicMissing(topic)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            for messages in batch.values():
                for message in messages:
                    yield message
    finally:
        await consumer.stop()
