"""Kafka wiring shared by the stages: clients, topics, and the transactional loop.

Producers are idempotent with acks=all; consumers read committed and never
auto-commit. Every topic is keyed by run id and created with the same
partition count (`create_topics`), so the topics are co-partitioned.

The consume-transform-produce loop: `run_transactional_stage`
---------------------------------------------------------------

    await run_transactional_stage(stop, bootstrap=..., group_id="callgate-validator",
                                  input_topics=[names.items, names.approvals],
                                  factory=make_processor)

Ownership. The unit of ownership is a *partition number* p across all input
topics: the range assignor gives partition p of every input topic to the same
member, so a stage reading two topics (the validator: items and approvals)
sees a run's records from both in one processor. Input topics must have equal
partition counts; the loop refuses to start otherwise.

Fencing. Each owned partition number has its own transactional producer,
`transactional_id = f"{prefix}-{group_id}-{p}"` (aiokafka has no KIP-447, so
this is the pre-2.5 scheme faust uses). Creating it aborts whatever a previous
owner left open, and the broker refuses that owner's later writes: a SIGKILLed
or paused worker cannot commit twice. A producer that finds itself fenced
drops the partition until the next assignment, it never re-fences the owner.

The processor protocol (what a stage supplies):

    def factory(partition: int,
                committed: dict[TopicPartition, OffsetAndMetadata],
                reader: PartitionReader) -> Processor | Awaitable[Processor]

  Called after the new producer has fenced the previous owner, with the
  committed input offsets of that partition number (one entry per input topic
  partition that has ever been committed; absent means "from the beginning")
  and the metadata string stored with each. Every entry carries the metadata
  of the same commit_metadata() call. To rebuild state by deterministic
  replay, store an offset in the metadata and call
  `await reader.read(tp, start, end)` for the committed records in [start, end).

    class Processor(Protocol):
        def process(self, records: list[ConsumerRecord]) -> list[Output]
        def tick(self, now_ms: int) -> list[Output]
        def commit_metadata(self) -> str

  process() gets the next records of its partition number, every input topic
  interleaved by timestamp, each topic's records in offset order (record.topic
  tells them apart). tick() is called about every `tick_interval_ms` for
  time-driven outputs (idle deadlines). Both are pure (no I/O, no awaits) and
  return the records to write. commit_metadata() (< 4 KiB, the broker's
  offset.metadata.max.bytes) is read right after process()/tick() and stored
  with the offsets in the same transaction.

  A processor must not raise on bad input (turn it into a DLQ Output): an
  exception aborts the transaction, discards the processor and rebuilds it
  from the committed offsets, then the same records come again.

  State contract. After any transaction the processor's state must be
  reproducible by the factory from (committed offsets, metadata, replay of the
  committed input). That includes state changed by tick(): if a tick emits a
  timeout, the metadata (or the replayed input) must say so, or a rebuilt
  processor will emit it again.

Per batch and partition: begin, send the offsets with the metadata (before the
records: the workaround for aiokafka #1004), send the outputs, commit. A batch
is processed partition by partition, then the partitions' transactions commit
concurrently (one producer each, so their round trips overlap). On any
failure: abort, drop the processor and producer, and rebuild both from what
committed (immediately, then with backoff): nothing is half-applied, so a
read_committed reader sees each input's outputs exactly once. A dead aiokafka
sender (e.g. the KeyError race of aiokafka #1098) surfaces as a failed commit
and takes the same path, with a fresh producer.

Rebalances are eager (aiokafka has no cooperative protocol): every partition
is revoked and then reassigned. A processor whose committed offsets and
metadata are still exactly what it last committed survives that (with a new
producer, which re-fences); any other is rebuilt by the factory.

Metrics. Every tick the loop sets callgate_consumer_lag_records{stage,topic,
partition} for the partitions it owns (callgate.metrics.LagTracker); the
stage label is `metrics_stage`, or inferred from a group id ending in a stage
name ("<namespace>-validator"). Counting events and decisions is the
processor's job (on its live path, not during replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaConnectionError, ProducerFenced, for_code
from aiokafka.structs import OffsetAndMetadata

from callgate.logging import get_logger
from callgate.metrics import LagTracker, stage_of
from callgate.topics import TopicNames

__all__ = [
    "OffsetAndMetadata",
    "Output",
    "PartitionReader",
    "Processor",
    "ProcessorFactory",
    "TopicMissing",
    "TransactionalStage",
    "create_topics",
    "delete_topics",
    "iter_topic",
    "make_consumer",
    "make_producer",
    "partition_counts",
    "read_topic",
    "run_transactional_stage",
]

log = get_logger("callgate.kafka")

TOPIC_ALREADY_EXISTS = 36
RETRY_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
STAGE_RETRY_BACKOFF_MS = 5  # the stage producers' retry_backoff_ms; see TransactionalStage._acquire


class TopicMissing(ValueError):
    """The topic does not exist (run `callgate topics create`)."""


@dataclass(frozen=True, slots=True)
class Output:
    """One record to write: key is the run id (the partition key everywhere)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


class Processor(Protocol):
    def process(self, records: list[ConsumerRecord]) -> list[Output]: ...

    def tick(self, now_ms: int) -> list[Output]: ...

    def commit_metadata(self) -> str: ...


ProcessorFactory = Callable[
    [int, dict[TopicPartition, OffsetAndMetadata], "PartitionReader"],
    "Processor | Awaitable[Processor]",
]


async def make_producer(bootstrap: str, *, transactional_id: str | None = None, **kw: Any) -> AIOKafkaProducer:
    """A started producer, idempotent with acks=all; with a transactional_id it has fenced older owners."""
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
    """A started read_committed consumer that never commits by itself."""
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
        if not wanted:
            return []
        response = await admin.create_topics(
            [
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
        )
        created = []
        for topic, code, *_ in response.topic_errors:
            if code == 0:
                created.append(topic)
            elif code != TOPIC_ALREADY_EXISTS:  # a concurrent creator won the race: fine
                raise for_code(code)(f"creating topic {topic}")
        await _wait_for_leaders(admin, [spec.name for spec in wanted], partitions)
        return created
    finally:
        await admin.close()


async def _wait_for_leaders(admin: AIOKafkaAdminClient, topics: list[str], partitions: int,
                            timeout_s: float = 30.0) -> None:
    """Return once every partition of the new topics has a leader, so first clients see no NotLeader errors."""
    deadline = time.monotonic() + timeout_s
    while True:
        described = await admin.describe_topics(topics)
        ready = [
            t for t in described
            if t["error_code"] == 0 and len(t["partitions"]) == partitions
            and all(p["error_code"] == 0 and p["leader"] >= 0 for p in t["partitions"])
        ]
        if len(ready) == len(topics):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(topics) - len(ready)} new topics have no partition leaders after {timeout_s}s")
        await asyncio.sleep(0.1)  # polling metadata under a deadline


async def delete_topics(bootstrap: str, names: TopicNames) -> None:
    """Delete a namespace's topics (tests clean up after themselves)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [spec.name for spec in names.specs() if spec.name in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()


async def partition_counts(bootstrap: str, topics: Sequence[str], *, timeout_s: float = 10.0) -> dict[str, int]:
    """Partition count per topic, 0 for a topic that does not exist (waits briefly for a new topic's metadata)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            described = await admin.describe_topics(list(topics))
            counts = {d["topic"]: (len(d["partitions"]) if d["error_code"] == 0 else 0) for d in described}
            if all(counts.get(t) for t in topics) or time.monotonic() > deadline:
                return {t: counts.get(t, 0) for t in topics}
            await asyncio.sleep(0.2)  # metadata of a just-created topic: poll under the deadline
    finally:
        await admin.close()


class PartitionReader:
    """Re-reads committed records of an input partition, for state recovery by replay."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap

    async def read(self, tp: TopicPartition, start: int, end: int, *, timeout_s: float = 60.0) -> list[ConsumerRecord]:
        """The committed records with start <= offset < end (aborted ones and markers are skipped)."""
        if end <= start:
            return []
        consumer = await make_consumer(self._bootstrap, group_id=None)
        try:
            consumer.assign([tp])
            # never wait for offsets that do not exist yet
            end = min(end, (await consumer.end_offsets([tp]))[tp])
            consumer.seek(tp, start)
            records: list[ConsumerRecord] = []
            deadline = time.monotonic() + timeout_s
            # transaction markers take offsets too, so the position, not the last record, says "done"
            while await consumer.position(tp) < end:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replay of {tp.topic}[{tp.partition}] {start}..{end} took over {timeout_s}s")
                batch = await consumer.getmany(tp, timeout_ms=500, max_records=5000)
                records.extend(r for r in batch.get(tp, []) if r.offset < end)
            return records
        finally:
            await consumer.stop()


@dataclass(slots=True)
class _Owned:
    producer: AIOKafkaProducer
    processor: Processor
    tps: list[TopicPartition]
    committed: dict[TopicPartition, OffsetAndMetadata] = field(default_factory=dict)

    def next_offset(self, tp: TopicPartition) -> int:
        committed = self.committed.get(tp)
        return committed.offset if committed is not None else 0


class _Listener(ConsumerRebalanceListener):
    def __init__(self, stage: TransactionalStage) -> None:
        self._stage = stage

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._stage._on_revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._stage._on_assigned({tp.partition for tp in assigned})


def _fenced(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, ProducerFenced):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
        producer_options: dict[str, Any] | None = None,
        metrics_stage: str | None = None,
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
        self.producer_options = producer_options or {}
        self._reader = PartitionReader(bootstrap)
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()  # rebalance callbacks run beside the loop: one at a time
        self._assigned: set[int] = set()
        self._owned: dict[int, _Owned] = {}
        self._suspended: dict[int, _Owned] = {}  # revoked, maybe about to come back
        self._retry_at: dict[int, tuple[float, int]] = {}  # partition -> (when, attempt)
        self._fenced: set[int] = set()  # another owner took it; wait for the next assignment
        self.commits = 0  # committed transactions, for tests and metrics
        self.builds = 0  # processors made by the factory
        self.start_attempts = 0  # tries to reach the broker and find the inputs at start
        # consumer lag per owned input partition, refreshed every tick; no stage name, no lag series
        stage = metrics_stage or stage_of(group_id)
        self._lag = LagTracker(stage) if stage is not None else None

    @property
    def owned_partitions(self) -> frozenset[int]:
        return frozenset(self._owned)

    def transactional_id(self, partition: int) -> str:
        return f"{self.prefix}-{self.group_id}-{partition}"

    # -- ownership -------------------------------------------------------

    async def _on_revoked(self, partitions: set[int]) -> None:
        async with self._lock:
            for partition in partitions:
                owned = self._owned.pop(partition, None)
                if owned is not None:
                    self._suspended[partition] = owned
            self._assigned -= partitions
            for partition in partitions:
                self._retry_at.pop(partition, None)

    async def _on_assigned(self, partitions: set[int]) -> None:
        async with self._lock:
            self._assigned = set(partitions)
            self._fenced.clear()
            for partition in sorted(partitions):
                await self._try_acquire(partition)
            for partition in list(self._suspended):
                await self._close(self._suspended.pop(partition))

    async def _try_acquire(self, partition: int) -> None:
        try:
            await self._acquire(partition)
        except Exception as exc:  # noqa: BLE001 - retried from the loop with backoff
            self._schedule_retry(partition, exc)
        else:
            self._retry_at.pop(partition, None)

    def _schedule_retry(self, partition: int, exc: BaseException) -> None:
        _, attempt = self._retry_at.get(partition, (0.0, 0))
        delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
        self._retry_at[partition] = (time.monotonic() + delay, attempt + 1)
        log.warning("partition not acquired; retrying", stage=self.group_id, partition=partition,
                    error_class=type(exc).__name__, attempt=attempt + 1)

    async def _acquire(self, partition: int) -> None:
        """Fence the previous owner, then reuse or build the processor and seek to the committed offsets."""
        assert self._consumer is not None
        tps = [TopicPartition(topic, partition) for topic in self.input_topics]
        # aiokafka backs off retry_backoff_ms (default 100) whenever the broker answers
        # CONCURRENT_TRANSACTIONS, which it does to the AddOffsetsToTxn of a transaction that
        # begins before the previous one's markers are written: at light load, most batches.
        # The markers take a few ms here; 20 ms retries made that a 20-25 ms p90 step per
        # stage, 5 ms retries a ~10 ms one (bench/latency_trace.py), for more broker requests.
        options = {"retry_backoff_ms": STAGE_RETRY_BACKOFF_MS, **self.producer_options}
        producer = await make_producer(
            self.bootstrap, transactional_id=self.transactional_id(partition), **options
        )
        try:
            committed = await self._fetch_committed(tps)
            previous = self._suspended.pop(partition, None)
            if previous is not None:
                await self._close(previous)
            if previous is not None and previous.committed == committed:
                processor = previous.processor  # nobody committed since us: its state is still true
            else:
                built = self.factory(partition, committed, self._reader)
                processor = await built if inspect.isawaitable(built) else built
                self.builds += 1
            for tp in tps:
                if tp in committed:
                    self._consumer.seek(tp, committed[tp].offset)
                else:
                    await self._consumer.seek_to_beginning(tp)
        except BaseException:
            await producer.stop()
            raise
        self._owned[partition] = _Owned(producer, processor, tps, committed)
        log.info("partition acquired", stage=self.group_id, partition=partition)

    async def _fetch_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        # the admin client, not consumer.committed(): that one drops the metadata
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(self.group_id, partitions=tps)
        finally:
            await admin.close()
        return {
            tp: OffsetAndMetadata(meta.offset, meta.metadata or "")
            for tp, meta in offsets.items()
            if meta.offset is not None and meta.offset >= 0
        }

    async def _close(self, owned: _Owned) -> None:
        with contextlib.suppress(Exception):
            await owned.producer.stop()

    async def _drop(self, partition: int, exc: BaseException) -> None:
        """A failed transaction left the processor ahead of Kafka: discard it, rebuild from what committed."""
        owned = self._owned.pop(partition, None)
        if owned is not None:
            await self._close(owned)
        if _fenced(exc):
            self._fenced.add(partition)
            log.warning("fenced by a newer owner; partition dropped", stage=self.group_id, partition=partition)
        else:
            self._schedule_retry(partition, exc)

    async def _retry_due(self) -> None:
        now = time.monotonic()
        for partition, (when, _) in sorted(self._retry_at.items()):
            if when <= now and partition in self._assigned and partition not in self._fenced:
                await self._try_acquire(partition)

    # -- transactions ----------------------------------------------------

    async def _commit(self, owned: _Owned, outputs: list[Output], advanced: dict[TopicPartition, int]) -> None:
        producer = owned.producer
        metadata = owned.processor.commit_metadata()
        positions = {tp: om.offset for tp, om in owned.committed.items()} | advanced
        offsets = {tp: OffsetAndMetadata(offset, metadata) for tp, offset in positions.items()}
        await producer.begin_transaction()
        try:
            if offsets:
                await producer.send_offsets_to_transaction(offsets, self.group_id)
            futures = [
                await producer.send(o.topic, o.value, key=o.key, headers=list(o.headers) or None) for o in outputs
            ]
            await producer.commit_transaction()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.abort_transaction()
            raise
        for future in futures:
            future.result()  # committed means acknowledged; this only surfaces a delivery error
        owned.committed = offsets
        self.commits += 1

    async def _handle(self, batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        per_partition: dict[int, list[list[ConsumerRecord]]] = {}
        for tp, records in batches.items():
            owned = self._owned.get(tp.partition)
            if owned is None:
                continue  # not ours (yet): acquiring seeks back to the committed offsets
            # a fetch from before a rebalance or a rebuild may repeat what is already committed
            start = owned.next_offset(tp)
            fresh = [r for r in records if r.offset >= start]
            if fresh:
                per_partition.setdefault(tp.partition, []).append(fresh)
        ready: list[tuple[int, _Owned, list[Output], dict[TopicPartition, int], int]] = []
        for partition, per_topic in per_partition.items():
            owned = self._owned[partition]
            advanced = {TopicPartition(rs[0].topic, partition): rs[-1].offset + 1 for rs in per_topic}
            records = list(heapq.merge(*per_topic, key=lambda r: r.timestamp))
            try:
                outputs = owned.processor.process(records)
            except Exception as exc:  # noqa: BLE001 - any failure means: rebuild from committed
                log.warning("transaction failed", stage=self.group_id, partition=partition,
                            error_class=type(exc).__name__, records=len(records))
                await self._drop(partition, exc)
                continue
            ready.append((partition, owned, outputs, advanced, len(records)))
        # Each partition has its own producer and transaction, so their round trips
        # overlap: a batch costs its slowest commit, not the sum of them.
        results = await asyncio.gather(
            *(self._commit(owned, outputs, advanced) for _, owned, outputs, advanced, _ in ready),
            return_exceptions=True,
        )
        for (partition, _, _, _, count), result in zip(ready, results):
            if isinstance(result, Exception):
                log.warning("transaction failed", stage=self.group_id, partition=partition,
                            error_class=type(result).__name__, records=count)
                await self._drop(partition, result)
            elif isinstance(result, BaseException):
                raise result  # cancellation: not a failed transaction
            elif self.on_batch is not None:
                self.on_batch(partition, count)

    async def _tick(self) -> None:
        now_ms = int(time.time() * 1000)
        for partition, owned in list(self._owned.items()):
            try:
                outputs = owned.processor.tick(now_ms)
                if outputs:
                    await self._commit(owned, outputs, {})
            except Exception as exc:  # noqa: BLE001
                log.warning("tick transaction failed", stage=self.group_id, partition=partition,
                            error_class=type(exc).__name__)
                await self._drop(partition, exc)

    async def _check_copartitioned(self) -> None:
        counts = await partition_counts(self.bootstrap, self.input_topics)
        if 0 in counts.values():
            raise TopicMissing(", ".join(sorted(t for t, n in counts.items() if n == 0)))
        if len(set(counts.values())) > 1:
            raise ValueError(f"input topics must have equal partition counts: {counts}")

    async def _start(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> bool:
        """Start once the broker answers and the inputs exist.

        A broker that is down or restarting, or topics not provisioned yet, are
        waited for (with a warning each try) rather than fatal, so a worker
        started beside its broker does not need a supervisor to come up.
        """
        delay = 0.5
        while not stop.is_set():
            self.start_attempts += 1
            try:
                await self._check_copartitioned()
                await consumer.start()
                return True
            except (KafkaConnectionError, TopicMissing) as exc:
                log.warning("broker or input topics not ready at start; retrying", stage=self.group_id,
                            error_class=type(exc).__name__)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, 5.0)
        return False

    async def run(self, stop: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            **self.consumer_options,
        )
        if not await self._start(consumer, stop):
            return
        self._consumer = consumer
        try:
            consumer.subscribe(self.input_topics, listener=_Listener(self))
            last_tick = time.monotonic()
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=self.tick_interval_ms, max_records=self.max_records)
                async with self._lock:
                    if batches:
                        await self._handle(batches)
                    if time.monotonic() - last_tick >= self.tick_interval_ms / 1000:
                        last_tick = time.monotonic()
                        await self._tick()
                        if self._lag is not None:
                            await self._lag.update(consumer, [tp for o in self._owned.values() for tp in o.tps])
                    if self._retry_at:
                        await self._retry_due()
        finally:
            async with self._lock:
                for owned in [*self._owned.values(), *self._suspended.values()]:
                    await self._close(owned)
                self._owned.clear()
                self._suspended.clear()
            if self._lag is not None:
                self._lag.clear()
            await consumer.stop()


async def run_transactional_stage(
    stop: asyncio.Event,
    *,
    bootstrap: str,
    group_id: str,
    input_topics: Sequence[str],
    factory: ProcessorFactory,
    **options: Any,
) -> None:
    """Run the loop until `stop` is set; options are TransactionalStage's keyword arguments."""
    stage = TransactionalStage(
        bootstrap=bootstrap, group_id=group_id, input_topics=input_topics, factory=factory, **options
    )
    await stage.run(stop)


async def _assign_whole_topic(consumer: AIOKafkaConsumer, bootstrap: str, topic: str) -> list[TopicPartition]:
    count = (await partition_counts(bootstrap, [topic]))[topic]
    if not count:
        raise TopicMissing(topic)
    tps = [TopicPartition(topic, p) for p in range(count)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    return tps


async def read_topic(
    bootstrap: str,
    topic: str,
    *,
    until: Callable[[list[ConsumerRecord]], bool] | None = None,
    timeout_s: float = 30.0,
) -> list[ConsumerRecord]:
    """Read a whole topic from the beginning with read_committed (no group).

    Without `until`, reads to the end offsets seen at the start (the last
    stable offsets, so an open transaction makes it wait). With it, reads
    until `until(records)` holds. Raises TimeoutError at the deadline.
    """
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        tps = await _assign_whole_topic(consumer, bootstrap, topic)
        end = await consumer.end_offsets(tps) if until is None else None
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if until is not None and until(records):
                return records
            if end is not None and all([await consumer.position(tp) >= end[tp] for tp in tps]):
                return records
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: condition not met within {timeout_s}s ({len(records)} records)")
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                records.extend(messages)
    finally:
        await consumer.stop()


async def iter_topic(bootstrap: str, topic: str) -> AsyncIterator[ConsumerRecord]:
    """Follow a whole topic from the beginning, forever (read_committed, no group)."""
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        await _assign_whole_topic(consumer, bootstrap, topic)
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            for messages in batch.values():
                for message in messages:
                    yield message
    finally:
        await consumer.stop()
