"""docker-compose.yml (no Docker engine here: checked as data) and `callgate topics` through the real broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from callgate.kafka import delete_topics
from callgate.topics import TopicNames

REPO = Path(__file__).resolve().parents[2]
WORKERS = ("ingest", "normalizer", "validator", "executor")


def test_compose_runs_kafka_4_in_kraft_and_one_scalable_service_per_worker():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert int(kafka["environment"]["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == 1
    assert services["topics"]["command"][:2] == ["topics", "create"]
    for name in WORKERS:
        service = services[name]
        assert service["command"][0] == name
        assert service["build"] == "."
        assert service["environment"]["CALLGATE_KAFKA_BOOTSTRAP"] == "kafka:9092"
        # `--scale normalizer=3` needs no fixed name and no fixed host port
        assert "container_name" not in service
        assert not any(":" in str(port) for port in service.get("ports", []))
        assert service["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert (REPO / "Dockerfile").read_text().count("pip install") == 1


def _callgate(*args: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CALLGATE_KAFKA_BOOTSTRAP": bootstrap}
    return subprocess.run([sys.executable, "-m", "callgate.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.kafka
def test_topics_create_is_idempotent_and_list_shows_them(kafka_bootstrap):
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    try:
        first = _callgate("topics", "create", "--namespace", names.namespace, "--partitions", "2",
                          bootstrap=kafka_bootstrap)
        assert first.returncode == 0, first.stderr
        assert first.stdout.count(" created ") == len(names.specs())
        again = _callgate("topics", "create", "--namespace", names.namespace, bootstrap=kafka_bootstrap)
        assert again.returncode == 0, again.stderr
        assert again.stdout.count(" exists ") == len(names.specs())
        listed = _callgate("topics", "list", bootstrap=kafka_bootstrap)
        assert {spec.name for spec in names.specs()} <= set(listed.stdout.split())
    finally:
        asyncio.run(delete_topics(kafka_bootstrap, names))
