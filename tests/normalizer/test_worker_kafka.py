"""The normalizer worker through the real broker: fixtures end to end, idle deadline, SIGKILL at random points."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest

from callgate.avro import decode, encode
from callgate.kafka import make_producer, read_topic
from callgate.records import AttemptStarted, AuditRecord, DeadLetter, QuarantinedBuffer, TerminalItem
from callgate.settings import DataHandling, Settings
from normalizer.accumulator import Normalizer
from normalizer.check import DEFAULT_POLICY, DEFAULT_TOOLS, load_validator
from normalizer.worker import run_normalizer
from validator.core import RunState

from tests.normalizer.support import REPO, expect_files, fixture_run, load_expect, messages_records

pytestmark = pytest.mark.kafka

FAST_GROUP = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
VALIDATOR = load_validator(DEFAULT_TOOLS, DEFAULT_POLICY)


def fixture_batch(copies: int = 1):
    """(records in publish order, expectation per run id) for every fixture, `copies` runs each."""
    now = int(time.time() * 1000)
    records, expected = [], {}
    for copy in range(copies):
        for path in expect_files():
            expect = load_expect(path)
            run_id = f"run-{path.parent.name[:6]}-{path.name.split('.')[0]}-{copy}-{uuid.uuid4().hex[:6]}"
            records += fixture_run(expect, path.parent, run_id, start_ms=now)
            expected[run_id] = expect
    return records, expected


async def publish(bootstrap: str, topic: str, records) -> None:
    producer = await make_producer(bootstrap)
    try:
        futures = [await producer.send(topic, encode(r), key=r.run_id.encode()) for r in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read_values(bootstrap: str, topic: str, *, at_least: int | None = None, timeout_s: float = 30.0):
    until = None if at_least is None else (lambda rs: len(rs) >= at_least)
    return [decode(r.value, topic=r.topic, partition=r.partition, offset=r.offset)
            for r in await read_topic(bootstrap, topic, until=until, timeout_s=timeout_s)]


def reference(records) -> list:
    """What an uninterrupted core outputs for these records."""
    return Normalizer().feed_all(records)


def item_key(o) -> tuple:
    if isinstance(o, TerminalItem):
        return ("item", o.run_id, o.attempt_id, o.response_id, o.item_id, o.tool_name, o.arguments, o.provider_event)
    if isinstance(o, DeadLetter):
        return ("dlq", o.run_id, o.attempt_id, o.response_id, o.item_id, o.call_id is None, o.reason, o.detail_code,
                o.byte_count)
    assert isinstance(o, AuditRecord)
    return ("audit", o.run_id, o.attempt_id, o.item_id, o.state, o.error_class, o.buffer_bytes,
            tuple(sorted(o.extra.items())))


async def test_fixtures_through_the_broker(kafka_bootstrap, topics) -> None:
    records, expected = fixture_batch()
    await publish(kafka_bootstrap, topics.sse_raw, records)
    want = reference(records)
    n_items = sum(isinstance(o, TerminalItem) for o in want)
    n_dlq = sum(isinstance(o, DeadLetter) for o in want)
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_namespace=topics.namespace,
                        data_handling=DataHandling.KEEP)
    stop = asyncio.Event()
    task = asyncio.create_task(run_normalizer(settings, stop, consumer_options=FAST_GROUP))
    try:
        await read_values(kafka_bootstrap, topics.items, at_least=n_items, timeout_s=90)
        await read_values(kafka_bootstrap, topics.dlq, at_least=n_dlq, timeout_s=60)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    items = await read_values(kafka_bootstrap, topics.items)
    dlq = await read_values(kafka_bootstrap, topics.dlq)
    audit = await read_values(kafka_bootstrap, topics.audit)
    kept = await read_values(kafka_bootstrap, topics.quarantine)
    assert Counter(map(item_key, items + dlq + audit)) == Counter(map(item_key, want))
    # per run, in order: normalizer + validator reach exactly the expectation files' verdicts
    per_run: dict[str, list] = {}
    states = {run: RunState(run) for run in expected}
    for o in sorted(items + [d for d in dlq if d.call_id], key=lambda o: (o.run_id, _time(o))):
        if isinstance(o, TerminalItem):
            decision = VALIDATOR.decide(o, states[o.run_id], now_ms=o.terminal_at)
            verdict = (o.item_id, decision.state.value, getattr(decision, "reason", None))
            verdict = verdict[:2] + ((verdict[2].value if verdict[2] else None),)
        else:
            verdict = (o.item_id, o.state, o.reason)
        per_run.setdefault(o.run_id, []).append(verdict)
    for run_id, expect in expected.items():
        assert per_run.get(run_id, []) == [(i["item_id"], i["state"], i["reason"]) for i in expect["items"]], run_id
    # keep mode: each quarantined item's bytes went to the restricted topic, never into the DLQ record
    quarantined = {d.call_id for d in dlq if d.call_id}
    assert {k.call_id for k in kept} == quarantined and all(isinstance(k, QuarantinedBuffer) for k in kept)


def _time(o) -> int:
    return o.terminal_at if isinstance(o, TerminalItem) else o.observed_at


async def test_idle_run_is_quarantined_by_a_replayable_marker(kafka_bootstrap, topics) -> None:
    now = int(time.time() * 1000)
    run_id = f"run-idle-{uuid.uuid4().hex[:6]}"
    msgs = [("response.created", '{"type":"response.created","response":{"id":"resp_1"}}'),
            ("response.output_item.added", '{"type":"response.output_item.added","item":{"type":"function_call",'
             '"id":"fc_1","name":"read_file","call_id":"call_1","arguments":""}}'),
            ("response.function_call_arguments.delta",
             '{"type":"response.function_call_arguments.delta","item_id":"fc_1","delta":"{\\"pa"}')]
    records = messages_records(msgs, "openai-responses", run_id=run_id, attempt_id="att-1", end=None)
    records = [r if isinstance(r, AttemptStarted) else r.__class__(**{**_fields(r), "received_at": now})
               for r in records]
    await publish(kafka_bootstrap, topics.sse_raw, records)
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_namespace=topics.namespace, run_idle_deadline_s=1.0)
    stop = asyncio.Event()
    task = asyncio.create_task(run_normalizer(settings, stop, consumer_options=FAST_GROUP))
    try:
        dlq = await read_values(kafka_bootstrap, topics.dlq, at_least=1, timeout_s=60)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert [(d.run_id, d.reason, d.byte_count) for d in dlq] == [(run_id, "run_idle_deadline", 4)]
    raw = await read_values(kafka_bootstrap, topics.sse_raw)
    markers = [r for r in raw if getattr(r, "reason", None) == "run_idle_deadline"]
    assert markers and markers[0].run_id == run_id  # the marker is input, so a replay sees it too


def _fields(record) -> dict:
    return {name: getattr(record, name) for name in record.__slots__}


def _start(env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.normalizer.crash_worker", "15"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def test_sigkill_at_random_points_gives_the_uninterrupted_output(kafka_bootstrap, topics, tmp_path) -> None:
    rng = random.Random(4)
    records, _ = fixture_batch(copies=2)
    want = reference(records)
    n_items = sum(isinstance(o, TerminalItem) for o in want)
    n_dlq = sum(isinstance(o, DeadLetter) for o in want)
    await publish(kafka_bootstrap, topics.sse_raw, records)
    env = {**os.environ, "CALLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap, "CALLGATE_TOPIC_NAMESPACE": topics.namespace,
           "PYTHONPATH": str(REPO)}
    kills, at_kill = 0, []
    with open(tmp_path / "worker.log", "ab") as log:
        for fraction in sorted(rng.uniform(0.1, 0.9) for _ in range(3)):
            proc = _start(env, log)
            try:
                seen = await read_values(kafka_bootstrap, topics.items, at_least=int(n_items * fraction),
                                         timeout_s=60)
                at_kill.append(len(seen))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            kills += 1
        proc = _start(env, log)
        try:
            await read_values(kafka_bootstrap, topics.items, at_least=n_items, timeout_s=60)
            await read_values(kafka_bootstrap, topics.dlq, at_least=n_dlq, timeout_s=60)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    items = await read_values(kafka_bootstrap, topics.items)
    dlq = await read_values(kafka_bootstrap, topics.dlq)
    audit = await read_values(kafka_bootstrap, topics.audit)
    assert kills == 3
    assert any(0 < n < n_items for n in at_kill), at_kill  # killed mid-batch, with output already committed
    restores = [json.loads(line) for line in (tmp_path / "worker.log").read_text().splitlines()
                if "normalizer partition restored" in line]
    assert len(restores) >= 3 * 4  # every start rebuilt its partitions from the committed offsets
    assert any(r["count"] >= 1 and r["records"] > 0 for r in restores)  # open attempts came back by replay
    got = Counter(map(item_key, items + dlq + audit))
    assert got == Counter(map(item_key, want))  # no item lost, none duplicated
    assert len({t.call_id for t in items}) == len(items)
