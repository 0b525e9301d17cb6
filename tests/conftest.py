"""Session-wide fixtures: a real Kafka broker and isolated topic namespaces.

Where the broker comes from, in order:
1. CALLGATE_KAFKA_BOOTSTRAP, when set (dev/test and .ci/run start one and set it);
2. testcontainers' Kafka module, when a Docker engine answers a ping within 2 s;
3. a LocalBroker (callgate/broker.py) started from the Maven Central jars for this session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from callgate.broker import LocalBroker, free_port
from callgate.kafka import create_topics, delete_topics
from callgate.topics import TopicNames


def _docker_answers() -> bool:
    try:
        import docker  # testcontainers' own client

        client = docker.from_env(timeout=2)  # fails at once when no socket or DOCKER_HOST exists
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means: no engine here
        return False


def _kafka_container():
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:
        from testcontainers.kafka import KafkaContainer
    return (
        KafkaContainer()
        .with_kraft()
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", "1000")
    )


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("CALLGATE_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    if _docker_answers():
        with _kafka_container() as container:
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
    """A fresh namespace with every topic of the design (3 partitions, to keep tests light), deleted after."""
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    await create_topics(kafka_bootstrap, names, partitions=3)
    yield names
    await delete_topics(kafka_bootstrap, names)
