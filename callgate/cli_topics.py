"""`callgate topics create|list`: provision every topic of the design."""

from __future__ import annotations

import argparse
import asyncio

from aiokafka.admin import AIOKafkaAdminClient

from callgate.kafka import create_topics
from callgate.settings import Settings
from callgate.topics import TopicNames


async def _create(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    names = TopicNames(args.namespace or settings.topic_namespace)
    created = await create_topics(args.bootstrap or settings.kafka_bootstrap, names, args.partitions or settings.partitions)
    for spec in names.specs():
        state = "created" if spec.name in created else "exists"
        print(f"{spec.name:40} {state:8} retention={'forever' if spec.retention_ms < 0 else f'{spec.retention_ms // 86_400_000}d'}"
              f"{' compacted' if spec.compacted else ''}{' restricted' if spec.restricted else ''}")
    return 0


async def _list(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    admin = AIOKafkaAdminClient(bootstrap_servers=args.bootstrap or settings.kafka_bootstrap)
    await admin.start()
    try:
        for name in sorted(await admin.list_topics()):
            if not name.startswith("__"):
                print(name)
    finally:
        await admin.close()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    topics = subparsers.add_parser("topics", help="provision and list Kafka topics")
    sub = topics.add_subparsers(dest="topics_command", required=True)
    create = sub.add_parser("create", help="create every topic of the design (idempotent)")
    create.add_argument("--partitions", type=int, help="partitions per topic (default: CALLGATE_PARTITIONS or 6)")
    create.add_argument("--namespace", help="topic namespace (default: CALLGATE_TOPIC_NAMESPACE or callgate)")
    create.add_argument("--bootstrap", help="Kafka bootstrap address (default: CALLGATE_KAFKA_BOOTSTRAP)")
    create.set_defaults(func=lambda a: asyncio.run(_create(a)))
    listing = sub.add_parser("list", help="list topics")
    listing.add_argument("--bootstrap")
    listing.set_defaults(func=lambda a: asyncio.run(_list(a)))
