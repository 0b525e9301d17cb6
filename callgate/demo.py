"""`callgate demo`: the pipeline end to end on the shipped fixtures."""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from callgate import avro
from callgate.kafka import create_topics, make_producer, read_topic
from callgate.records import RunRequest
from callgate.settings import Settings
from callgate.topics import TopicNames


async def _round_trip(bootstrap: str, names: TopicNames) -> None:
    record = RunRequest(
        run_id=f"run-{uuid.uuid4().hex[:12]}", route="openai-responses", model="demo",
        upstream_url="http://127.0.0.1:1/v1/responses", request_body=b"{}", tool_set=["read_file"],
        policy_id="demo", submitted_at=int(time.time() * 1000),
    )
    producer = await make_producer(bootstrap)
    try:
        await producer.send_and_wait(names.runs, avro.encode(record), key=record.run_id.encode())
    finally:
        await producer.stop()
    records = await read_topic(bootstrap, names.runs, until=lambda r: len(r) >= 1, timeout_s=30)
    decoded = avro.decode(records[0].value, topic=names.runs, partition=records[0].partition, offset=records[0].offset)
    assert decoded == record
    print(f"round trip through {names.runs}: {type(decoded).__name__} {decoded.run_id} ok")


async def _demo(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    names = TopicNames(args.namespace or f"demo{uuid.uuid4().hex[:6]}")
    created = await create_topics(settings.kafka_bootstrap, names, partitions=3)
    print(f"broker {settings.kafka_bootstrap}: {len(created)} topics provisioned under {names.namespace}.*")
    await _round_trip(settings.kafka_bootstrap, names)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run the pipeline end to end on the shipped fixtures")
    demo.add_argument("--namespace", help="topic namespace (default: a fresh demo namespace)")
    demo.set_defaults(func=lambda a: asyncio.run(_demo(a)))
