"""The Kafka wiring, through the real broker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import ProducerFenced

from callgate.kafka import (
    OffsetAndMetadata,
    Output,
    PartitionReader,
    TransactionalStage,
    create_topics,
    delete_topics,
    make_producer,
    read_topic,
)
from callgate.topics import TopicNames

pytestmark = pytest.mark.kafka

FAST_GROUP = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}


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
        await producer.flush()  # the aborted record really reaches the log
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send(topics.items, b"committed-2", key=b"r")
    finally:
        await producer.stop()
    records = await read_topic(kafka_bootstrap, topics.items, timeout_s=20)
    assert [r.value for r in records] == [b"committed-1", b"committed-2"]


async def test_a_newer_producer_fences_the_zombie(kafka_bootstrap, topics):
    txn_id = f"test-{uuid.uuid4().hex}"
    zombie = await make_producer(kafka_bootstrap, transactional_id=txn_id)
    successor = None
    try:
        await zombie.begin_transaction()
        await zombie.send(topics.items, b"from-zombie", key=b"r")
        await zombie.flush()
        successor = await make_producer(kafka_bootstrap, transactional_id=txn_id)  # aborts the open txn
        with pytest.raises(ProducerFenced):
            await zombie.commit_transaction()
        async with successor.transaction():
            await successor.send(topics.items, b"from-successor", key=b"r")
    finally:
        await zombie.stop()
        if successor is not None:
            await successor.stop()
    records = await read_topic(kafka_bootstrap, topics.items, timeout_s=20)
    assert [r.value for r in records] == [b"from-successor"]


async def test_create_topics_is_idempotent_and_sets_retention(kafka_bootstrap):
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    try:
        created = await create_topics(kafka_bootstrap, names, partitions=2)
        assert set(created) == {spec.name for spec in names.specs()}
        assert await create_topics(kafka_bootstrap, names, partitions=2) == []
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            # a topic created a moment ago can still answer UNKNOWN_TOPIC on another request path
            deadline = time.monotonic() + 20
            while True:
                described = await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, spec.name) for spec in names.specs()]
                )
                codes = [code for response in described for code, *_ in response.resources]
                if not any(codes) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            metadata = await admin.describe_topics([names.items])
        finally:
            await admin.close()
    finally:
        await delete_topics(kafka_bootstrap, names)
    configs = {}
    for response in described:
        for _code, _msg, _type, name, entries in response.resources:
            configs[name] = {entry[0]: entry[1] for entry in entries}
    for spec in names.specs():
        assert configs[spec.name]["cleanup.policy"] == ("compact" if spec.compacted else "delete")
        assert int(configs[spec.name]["retention.ms"]) == spec.retention_ms
    assert int(configs[names.dlq]["retention.ms"]) > int(configs[names.sse_raw]["retention.ms"])
    assert int(configs[names.audit]["retention.ms"]) > int(configs[names.items]["retention.ms"])
    assert len(metadata[0]["partitions"]) == 2


class Counter:
    """A processor whose state (a running count) comes back from the commit metadata."""

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


def counter_factory(out_topic: str, seen: list | None = None):
    def factory(partition, committed, reader: PartitionReader):
        if seen is not None:
            seen.append(committed)
        start = int(next(iter(committed.values())).metadata) if committed else 0
        return Counter(out_topic, start)

    return factory


async def _produce_inputs(bootstrap: str, topic: str, count: int, runs: int = 5, first: int = 0) -> None:
    producer = await make_producer(bootstrap)
    try:
        for i in range(first, first + count):
            await producer.send(topic, f"m{i}".encode(), key=f"run-{i % runs}".encode())
        await producer.flush()
    finally:
        await producer.stop()


async def _run_until(stage: TransactionalStage, condition, timeout_s: float = 45.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(stage.run(stop))
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)  # polling a condition under a deadline
    finally:
        stop.set()
        await task


def _assert_exactly_once(out, count: int, partitions: int) -> None:
    values = [r.value.split(b"|")[0] for r in out]
    assert sorted(values) == sorted(f"m{i}".encode() for i in range(count))  # none lost, none twice
    for partition in range(partitions):
        counts = [int(r.value.split(b"|")[1]) for r in out if r.partition == partition]
        assert counts == list(range(1, len(counts) + 1)), partition  # state carried over without gaps


async def test_transactional_stage_is_exactly_once_across_a_restart(kafka_bootstrap, topics):
    await _produce_inputs(kafka_bootstrap, topics.sse_raw, 60)
    group = f"g-{uuid.uuid4().hex[:8]}"
    seen: list[dict[TopicPartition, OffsetAndMetadata]] = []

    def stage():
        return TransactionalStage(bootstrap=kafka_bootstrap, group_id=group, input_topics=[topics.sse_raw],
                                  factory=counter_factory(topics.items, seen), max_records=7,
                                  transactional_prefix="test", consumer_options=FAST_GROUP)

    first = stage()
    await _run_until(first, lambda: first.commits >= 3)
    builds_before_restart = len(seen)

    second = stage()
    collector = asyncio.create_task(
        read_topic(kafka_bootstrap, topics.items, until=lambda r: len(r) >= 60, timeout_s=60)
    )
    await _run_until(second, collector.done)
    out = await collector
    _assert_exactly_once(out, 60, 3)
    # the second instance resumed from committed offsets and metadata, not from zero
    assert any(committed for committed in seen[builds_before_restart:])
    assert len(await read_topic(kafka_bootstrap, topics.items)) == 60  # and nothing trickled in later


async def test_two_members_rebalance_without_loss_or_duplicates(kafka_bootstrap, topics):
    await _produce_inputs(kafka_bootstrap, topics.sse_raw, 90, runs=9)
    group = f"g-{uuid.uuid4().hex[:8]}"

    def stage():
        return TransactionalStage(bootstrap=kafka_bootstrap, group_id=group, input_topics=[topics.sse_raw],
                                  factory=counter_factory(topics.items), max_records=3,
                                  transactional_prefix="test", consumer_options=FAST_GROUP)

    first, second = stage(), stage()
    stop = asyncio.Event()
    first_task = asyncio.create_task(first.run(stop))
    second_task = None
    try:
        async with asyncio.timeout(60):
            while first.commits < 2:
                await asyncio.sleep(0.05)  # polling a condition under a deadline
            second_task = asyncio.create_task(second.run(stop))  # joins mid-stream: a rebalance
            while not second.owned_partitions:
                await asyncio.sleep(0.05)
            await _produce_inputs(kafka_bootstrap, topics.sse_raw, 90, runs=9, first=90)  # work for both
            out = await read_topic(kafka_bootstrap, topics.items, until=lambda r: len(r) >= 180, timeout_s=60)
    finally:
        stop.set()
        await first_task
        if second_task is not None:
            await second_task
    assert first.owned_partitions == second.owned_partitions == frozenset()  # both let go on stop
    assert second.commits > 0  # the newcomer really took partitions over
    _assert_exactly_once(out, 180, 3)
    assert len(await read_topic(kafka_bootstrap, topics.items)) == 180


WORKER = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[4])
    from tests.foundation.test_kafka import FAST_GROUP, counter_factory
    from callgate.kafka import run_transactional_stage
    bootstrap, inp, out = sys.argv[1:4]
    asyncio.run(run_transactional_stage(asyncio.Event(), bootstrap=bootstrap, group_id=sys.argv[5],
        input_topics=[inp], factory=counter_factory(out), max_records=2, transactional_prefix="test",
        consumer_options=FAST_GROUP))
    """
)


async def test_a_sigkilled_member_is_fenced_and_its_work_finished_once(kafka_bootstrap, topics, tmp_path):
    await _produce_inputs(kafka_bootstrap, topics.sse_raw, 300, runs=7)
    group = f"g-{uuid.uuid4().hex[:8]}"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, kafka_bootstrap, topics.sse_raw, topics.items, repo, group],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.err", "wb"),
    )
    try:
        # kill it while it is busy: after some of its transactions committed, before all of them
        partial = await read_topic(kafka_bootstrap, topics.items, until=lambda r: len(r) >= 20, timeout_s=60)
        assert len(partial) >= 20
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    successor = TransactionalStage(bootstrap=kafka_bootstrap, group_id=group, input_topics=[topics.sse_raw],
                                   factory=counter_factory(topics.items), max_records=50,
                                   transactional_prefix="test", consumer_options=FAST_GROUP)
    collector = asyncio.create_task(
        read_topic(kafka_bootstrap, topics.items, until=lambda r: len(r) >= 300, timeout_s=90)
    )
    await _run_until(successor, collector.done, timeout_s=90)
    out = await collector
    assert len(partial) < 300  # the kill really landed mid-stream
    _assert_exactly_once(out, 300, 3)
    assert len(await read_topic(kafka_bootstrap, topics.items)) == 300


async def test_input_topics_must_be_copartitioned(kafka_bootstrap, topics):
    other = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    await create_topics(kafka_bootstrap, other, partitions=2)
    try:
        stage = TransactionalStage(bootstrap=kafka_bootstrap, group_id=f"g-{uuid.uuid4().hex[:8]}",
                                   input_topics=[topics.items, other.approvals], factory=counter_factory("x"))
        with pytest.raises(ValueError, match="equal partition counts"):
            await stage.run(asyncio.Event())
    finally:
        await delete_topics(kafka_bootstrap, other)


async def test_partition_reader_replays_committed_records_only(kafka_bootstrap, topics):
    producer = await make_producer(kafka_bootstrap, transactional_id=f"test-{uuid.uuid4().hex}")
    try:
        async with producer.transaction():
            for i in range(3):
                await producer.send(topics.runs, f"a{i}".encode(), partition=0)
        await producer.begin_transaction()
        await producer.send(topics.runs, b"aborted", partition=0)
        await producer.flush()
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send(topics.runs, b"b0", partition=0)
    finally:
        await producer.stop()
    tp = TopicPartition(topics.runs, 0)
    replayed = await PartitionReader(kafka_bootstrap).read(tp, 0, 10_000, timeout_s=20)
    assert [r.value for r in replayed] == [b"a0", b"a1", b"a2", b"b0"]
    assert [r.value for r in await PartitionReader(kafka_bootstrap).read(tp, 1, 3)] == [b"a1", b"a2"]


async def test_a_stage_started_before_its_broker_and_topics_waits_for_them(tmp_path) -> None:
    from callgate.broker import LocalBroker, free_port

    broker = LocalBroker(state_dir=tmp_path / "late-kafka", port=free_port())
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    stage = TransactionalStage(bootstrap=broker.address, group_id=f"g-{uuid.uuid4().hex[:8]}",
                               input_topics=[names.sse_raw], factory=counter_factory(names.items),
                               transactional_prefix="late")
    stop = asyncio.Event()
    task = asyncio.create_task(stage.run(stop))


    async def tried(times: int) -> None:
        async with asyncio.timeout(30):
            while stage.start_attempts < times:
                assert not task.done(), "the stage gave up instead of waiting"
                await asyncio.sleep(0.05)  # polling a condition under a deadline

    try:
        await tried(2)  # no broker yet: it retries
        await asyncio.to_thread(broker.start)
        await tried(stage.start_attempts + 2)  # a broker, but no input topics yet: it retries
        assert not task.done()
        await create_topics(broker.address, names, partitions=1)
        producer = await make_producer(broker.address)
        try:
            for i in range(3):
                await producer.send_and_wait(names.sse_raw, f"m{i}".encode(), key=b"run")
        finally:
            await producer.stop()
        out = await read_topic(broker.address, names.items, until=lambda r: len(r) >= 3, timeout_s=60)
        assert sorted(r.value for r in out) == [b"m0|1", b"m1|2", b"m2|3"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await asyncio.to_thread(broker.stop)
