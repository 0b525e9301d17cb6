"""The Kafka wiring, through the real broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from callgate.kafka import (
    Committed,
    Output,
    PartitionReader,
    TransactionalStage,
    create_topics,
    make_producer,
    read_topic,
)
from callgate.topics import TopicNames

pytestmark = pytest.mark.kafka


async def test_idempotent_producer_round_trip(kafka_bootstrap, topics):
    producer = await make_producer(kafka_bootstrap)
    try:
        for i in range(20):
            await producer.send_and_wait(topics.audit, f"v{i}".encode(), key=b"run-1")
    finally:
        await producer.stop()
    records = await read_topic(kafka_bootstrap, topics.audit, until=lambda r: len(r) >= 20, timeout_s=20)
    assert [r.value for r in records] == [f"v{i}".encode() for i in range(20)]
    assert {r.partition for r in records} == {records[0].partition}  # one key, one partition, in order


async def test_read_committed_never_sees_aborted_records(kafka_bootstrap, topics):
    producer = await make_producer(kafka_bootstrap, transactional_id=f"test-{uuid.uuid4().hex}")
    try:
        async with producer.transaction():
            await producer.send(topics.items, b"committed-1", key=b"r")
        await producer.begin_transaction()
        await producer.send(topics.items, b"aborted", key=b"r")
        await producer.flush()
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send(topics.items, b"committed-2", key=b"r")
    finally:
        await producer.stop()
    records = await read_topic(kafka_bootstrap, topics.items, timeout_s=20)
    assert [r.value for r in records] == [b"committed-1", b"committed-2"]


async def test_create_topics_is_idempotent_and_sets_retention(kafka_bootstrap):
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    created = await create_topics(kafka_bootstrap, names, partitions=2)
    assert set(created) == {spec.name for spec in names.specs()}
    assert await create_topics(kafka_bootstrap, names, partitions=2) == []
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, names.dlq), ConfigResource(ConfigResourceType.TOPIC, names.ledger),
             ConfigResource(ConfigResourceType.TOPIC, names.sse_raw)]
        )
    finally:
        await admin.close()
    configs = {}
    for response in described:
        for resource in response.resources:
            configs[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
    assert configs[names.ledger]["cleanup.policy"] == "compact"
    assert int(configs[names.dlq]["retention.ms"]) > int(configs[names.sse_raw]["retention.ms"])


class Doubler:
    """A processor whose state (a running count) is rebuilt by replay, like the normalizer's."""

    def __init__(self, out_topic: str, start_count: int) -> None:
        self.out_topic = out_topic
        self.count = start_count

    def process(self, records):
        outputs = []
        for record in records:
            self.count += 1
            outputs.append(Output(self.out_topic, record.key, record.value + b"|" + str(self.count).encode()))
        return outputs

    def tick(self, now_ms):
        return []

    def commit_metadata(self):
        return str(self.count)


async def _run_until(stage: TransactionalStage, condition, timeout_s: float = 45.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(stage.run(stop))
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task


async def test_transactional_stage_is_exactly_once_across_a_restart(kafka_bootstrap):
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    await create_topics(kafka_bootstrap, names, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    producer = await make_producer(kafka_bootstrap)
    try:
        for i in range(60):
            await producer.send(names.sse_raw, f"m{i}".encode(), key=f"run-{i % 5}".encode())
        await producer.flush()
    finally:
        await producer.stop()

    factories_seen: list[dict[TopicPartition, Committed]] = []

    async def factory(partition, committed, reader: PartitionReader):
        factories_seen.append(committed)
        start = int(next(iter(committed.values())).metadata) if committed else 0
        return Doubler(names.items, start)

    first = TransactionalStage(bootstrap=kafka_bootstrap, group_id=group, input_topics=[names.sse_raw],
                               factory=factory, max_records=7, transactional_prefix="test")
    await _run_until(first, lambda: first.commits >= 3)

    second = TransactionalStage(bootstrap=kafka_bootstrap, group_id=group, input_topics=[names.sse_raw],
                                factory=factory, max_records=7, transactional_prefix="test")
    out = []

    async def collect():
        out[:] = await read_topic(kafka_bootstrap, names.items, until=lambda r: len(r) >= 60, timeout_s=60)

    collector = asyncio.create_task(collect())
    await _run_until(second, lambda: collector.done())
    await collector
    values = [r.value.split(b"|")[0] for r in out]
    assert sorted(values) == sorted(f"m{i}".encode() for i in range(60))  # none lost, none twice
    # the second instance resumed from committed metadata, not from zero
    assert any(c for c in factories_seen[2:])
    # per partition, the counter carried across the restart has no gaps
    for partition in (0, 1):
        counts = [int(r.value.split(b"|")[1]) for r in out if r.partition == partition]
        assert counts == list(range(1, len(counts) + 1))
