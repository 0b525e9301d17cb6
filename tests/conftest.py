"""Session-wide fixtures: a real Kafka broker and isolated topic namespaces.

Where the broker comes from, in order:
1. CALLGATE_KAFKA_BOOTSTRAP, when set (dev/test and .ci/run start one and set it);
2. testcontainers' Kafka module, when a Docker engine answers a ping;
3. a LocalBroker started from the Maven Central jars for this session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from callgate.broker import LocalBroker, free_port
from callgate.kafka import create_topics
from callgate.topics import TopicNames


def _docker_answers() -> bool:
    try:
        import docker  # testcontainers' dependency

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("CALLGATE_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        container = (
            KafkaContainer()
            .with_kraft()
            .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
            .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        )
        with container:
            yield container.get_bootstrap_server()
        return
    broker = LocalBroker(state_dir=Path(tmp_path_factory.mktemp("kafka")), port=free_port())
    broker.start()
    try:
        yield broker.address
    finally:
        broker.stop()


@pytest.fixture
async def topics(kafka_bootstrap: str) -> AsyncIterator[TopicNames]:
    """A fresh namespace with every topic of the design created (3 partitions, to keep tests light)."""
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    await create_topics(kafka_bootstrap, names, partitions=3)
    yield names
