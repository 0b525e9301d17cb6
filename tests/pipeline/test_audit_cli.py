"""`callgate audit tail` and `callgate trace` read the real audit topic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from callgate import avro
from callgate.kafka import make_producer
from callgate.records import AuditRecord

pytestmark = pytest.mark.kafka


def _record(run: str, item: str, stage: str, state: str, at: int, reason: str | None = None) -> AuditRecord:
    return AuditRecord(
        observed_at=at, stage=stage, run_id=run, attempt_id="a1", response_id="r1", item_id=item,
        call_id=f"call-{item}", model_route="anthropic-messages", stream_event=None, tool_name="list_dir",
        buffer_bytes=17, terminal_seen=state != "QUARANTINED", json_status=None, trailing_data=None,
        schema_status=None, policy_status=None, execution_state=None, state=state, error_class=reason,
    )


async def test_tail_filters_by_run_and_trace_writes_a_page(kafka_bootstrap, topics, tmp_path):
    records = [
        _record("run-a", "i1", "normalizer", "ITEM_TERMINAL", 1000),
        _record("run-b", "i9", "normalizer", "QUARANTINED", 1001, "stream_error"),
        _record("run-a", "i1", "validator", "POLICY_APPROVED", 1010),
        _record("run-a", "i1", "executor", "EXECUTED", 1050),
    ]
    producer = await make_producer(kafka_bootstrap)
    try:
        for record in records:
            await producer.send_and_wait(topics.audit, avro.encode(record), key=record.run_id.encode())
        await producer.send_and_wait(topics.audit, b"not avro", key=b"run-a")  # skipped, not fatal
    finally:
        await producer.stop()
    env = {**os.environ, "CALLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap}
    tail = subprocess.run(
        [sys.executable, "-m", "callgate", "audit", "tail", "--namespace", topics.namespace, "--run", "run-a",
         "--no-follow"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [(line["stage"], line["state"]) for line in lines] == [
        ("normalizer", "ITEM_TERMINAL"), ("validator", "POLICY_APPROVED"), ("executor", "EXECUTED")]
    assert "skipped" in tail.stderr and "record_undecodable" in tail.stderr

    page = tmp_path / "trace.html"
    trace = subprocess.run(
        [sys.executable, "-m", "callgate", "trace", "run-a", "--namespace", topics.namespace, "--html", str(page)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    assert "final=EXECUTED" in trace.stdout and "i9" not in trace.stdout
    assert "EXECUTED" in page.read_text() and page.read_text().startswith("<!doctype html>")

    missing = subprocess.run(
        [sys.executable, "-m", "callgate", "trace", "run-zzz", "--namespace", topics.namespace],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert missing.returncode == 1 and "no audit records" in missing.stderr
