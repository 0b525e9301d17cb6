"""Through the real broker: a sample of the bad-input corpus, a good call, and an
approve / deny flow. None of the bad calls reaches the approved topic; the good
ones do, signed."""

from __future__ import annotations

import asyncio
import json

import pytest

from callgate.avro import decode, encode
from callgate.kafka import make_producer, read_topic
from callgate.records import ApprovedCall, DeadLetter, PendingCall
from callgate.signing import verify
from validator.cli import answer
from validator.worker import run_validator

from tests.validator.helpers import item, worker_settings

pytestmark = pytest.mark.kafka

KEY_HEX = "11" * 32

BAD_SAMPLE = [
    ("write_file", b'{"path":"ok.txt","path":"/etc/passwd","content":"x"}'),  # J3
    ("write_file", b'{"path":"a.txt","content":"x"} {"path":"b"}'),  # J8
    ("read_file", b'{"path":"a","max_bytes":NaN}'),  # J1
    ("read_file", b'\xef\xbb\xbf{"path":"a"}'),  # J7
    ("write_file", b'{"path":"../../etc/cron.d/x","content":"x"}'),  # P1
    ("write_file", b'{"path":"link_out/secret.txt","content":"x"}'),  # P4
    ("write_file", b'{"path":".GIT/config","content":"x"}'),  # P8
    ("run_command", b'{"argv":"git status; id"}'),  # 2.4 string command
    ("run_command", b'{"argv":["git","fetch","--upload-p=id"]}'),  # abbreviated option
    ("run_command", b'{"argv":["ls"],"env":{"LD_PRELOAD":"/tmp/x.so"}}'),  # env injection
    ("http_request", b'{"method":"GET","url":"https://example.com@evil.com/"}'),  # userinfo
    ("Write_File", b'{"path":"a","content":"x"}'),  # 2.5 tool name case
]


async def test_corpus_sample_good_call_and_approvals(kafka_bootstrap, topics, tmp_path) -> None:
    settings = worker_settings(kafka_bootstrap, topics.namespace, tmp_path, KEY_HEX, approval_ttl_s=600)
    bad = [item(tool, raw, run_id=f"run-bad-{i}") for i, (tool, raw) in enumerate(BAD_SAMPLE)]
    good = item("write_file", {"path": "src/new.py", "content": "print(1)\n"}, run_id="run-good")
    to_approve = item("http_request", {"method": "GET", "url": "https://example.com/a"}, run_id="run-good")
    to_deny = item("run_command", {"argv": ["git", "commit", "-m", "wip"]}, run_id="run-deny")

    producer = await make_producer(kafka_bootstrap)
    try:
        for it in [*bad, good, to_approve, to_deny]:
            await producer.send_and_wait(topics.items, encode(it), key=it.run_id.encode())
    finally:
        await producer.stop()

    stop = asyncio.Event()
    worker = asyncio.create_task(run_validator(settings, stop, group_id=f"{topics.namespace}-validator"))

    def decoded(records):
        return [decode(r.value) for r in records]

    try:
        pending = decoded(await read_topic(kafka_bootstrap, topics.calls_pending,
                                           until=lambda rs: len(rs) >= 2, timeout_s=90))
        assert {p.call_id for p in pending} == {to_approve.call_id, to_deny.call_id}
        assert all(isinstance(p, PendingCall) for p in pending)

        assert await answer(settings, to_approve.call_id, "approve", decided_by="alice") == 0
        assert await answer(settings, to_deny.call_id, "deny", decided_by="bob", why="not now") == 0

        approved = decoded(await read_topic(kafka_bootstrap, topics.calls_approved,
                                            until=lambda rs: len(rs) >= 2, timeout_s=90))
        dead = decoded(await read_topic(kafka_bootstrap, topics.dlq,
                                        until=lambda rs: len(rs) >= len(bad) + 1, timeout_s=90))
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)

    assert all(isinstance(a, ApprovedCall) for a in approved)
    assert {a.call_id for a in approved} == {good.call_id, to_approve.call_id}
    for call in approved:
        verify(call, {"k1": bytes.fromhex(KEY_HEX)})
    by_id = {a.call_id: a for a in approved}
    assert json.loads(by_id[good.call_id].arguments) == {"content": "print(1)\n", "path": "src/new.py"}
    assert by_id[good.call_id].approved_by == "policy" and by_id[to_approve.call_id].approved_by == "alice"

    bad_ids = {b.call_id for b in bad}
    assert not bad_ids & {a.call_id for a in approved}
    assert all(isinstance(d, DeadLetter) for d in dead)
    reasons = {d.call_id: d.reason for d in dead}
    assert bad_ids <= set(reasons)
    assert reasons[to_deny.call_id] == "approval_denied"
    assert reasons[bad[0].call_id] == "duplicate_key" and reasons[bad[1].call_id] == "trailing_data"
    assert reasons[bad[8].call_id] == "command_argument_denied"
    assert reasons[bad[11].call_id] == "unknown_tool"

    audit = decoded(await read_topic(kafka_bootstrap, topics.audit))
    raw_markers = [b"passwd", b"LD_PRELOAD", b"evil.com", b"print(1)"]
    for record in await read_topic(kafka_bootstrap, topics.audit):
        assert not any(m in record.value for m in raw_markers)
    assert {a.call_id for a in audit} >= bad_ids | {good.call_id}


async def test_pending_call_survives_a_restart(kafka_bootstrap, topics, tmp_path) -> None:
    settings = worker_settings(kafka_bootstrap, topics.namespace, tmp_path, KEY_HEX)
    call = item("http_request", {"method": "GET", "url": "https://example.com/r"}, run_id="run-restart")
    producer = await make_producer(kafka_bootstrap)
    try:
        await producer.send_and_wait(topics.items, encode(call), key=call.run_id.encode())
    finally:
        await producer.stop()
    group = f"{topics.namespace}-validator"

    stop = asyncio.Event()
    worker = asyncio.create_task(run_validator(settings, stop, group_id=group))
    try:
        await read_topic(kafka_bootstrap, topics.calls_pending, until=lambda rs: len(rs) >= 1, timeout_s=90)
        # wait until the worker has also consumed its pending call back (committed offset moved)
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                offsets = await admin.list_consumer_group_offsets(group)
                if any(tp.topic == topics.calls_pending and m.offset >= 1 for tp, m in offsets.items()):
                    break
                assert asyncio.get_running_loop().time() < deadline, "pending call never consumed"
                await asyncio.sleep(0.2)
        finally:
            await admin.close()
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)

    # the approval is written while no validator runs; a new one must rebuild the open call by replay
    assert await answer(settings, call.call_id, "approve", decided_by="carol") == 0
    stop = asyncio.Event()
    worker = asyncio.create_task(run_validator(settings, stop, group_id=group))
    try:
        approved = [decode(r.value) for r in await read_topic(
            kafka_bootstrap, topics.calls_approved, until=lambda rs: len(rs) >= 1, timeout_s=90)]
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)
    assert [a.call_id for a in approved] == [call.call_id]
    assert approved[0].approved_by == "carol"
    verify(approved[0], {"k1": bytes.fromhex(KEY_HEX)})
