"""Approval join, expiry, binding, signing and replay recovery, through the pure cores
(the worker's processor fed real aiokafka ConsumerRecords, no broker)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from aiokafka import ConsumerRecord

from callgate.avro import decode, encode
from callgate.errors import ExecutionError, Reason
from callgate.records import Approval, ApprovedCall, AuditRecord, DeadLetter, PendingCall
from callgate.signing import verify
from callgate.topics import TopicNames
from validator.approvals import ApprovalJoin, Granted, Refused, args_hmac, expire_marker
from validator.worker import ValidatorProcessor

from tests.validator.helpers import item, make_validator, make_workspace, write_policy

KEY = bytes(range(32))
KID = "k1"
TOPICS = TopicNames("t-approvals")


@pytest.fixture()
def validator(tmp_path):
    root = make_workspace(tmp_path)
    return make_validator(write_policy(tmp_path, root), approval_ttl_ms=60_000)


def pending_call(call_id="c1", args=b'{"a":1}', expires_at=10_000, version="7") -> PendingCall:
    return PendingCall(
        call_id=call_id, run_id="run-1", attempt_id="a", response_id="r", item_id="i", tool_name="http_request",
        arguments=args, args_hmac=args_hmac(KEY, call_id=call_id, tool_name="http_request", arguments=args,
                                            policy_id="test", policy_version=version),
        policy_id="test", policy_version=version, route="x", requested_at=0, expires_at=expires_at,
        why="network_access",
    )


def answer(p: PendingCall, decision: str, *, at=5_000, hmac_value=None) -> Approval:
    return Approval(call_id=p.call_id, decision=decision, decided_by="alice", decided_at=at, why=None,
                    run_id=p.run_id, args_hmac=p.args_hmac if hmac_value is None else hmac_value)


# ------------------------------------------------------------------ the pure join


def test_approve_deny_and_orphan_order() -> None:
    join = ApprovalJoin(orphan_ttl_ms=1000)
    p1, p2 = pending_call("c1"), pending_call("c2")
    assert join.add_pending(p1, 0) == []
    [granted] = join.on_approval(answer(p1, "approve"), 0)
    assert isinstance(granted, Granted)
    # the answer may be read before its pending call (two topics): it waits
    assert join.on_approval(answer(p2, "deny"), 1) == []
    [refused] = join.add_pending(p2, 1)
    assert isinstance(refused, Refused) and refused.reason is Reason.APPROVAL_DENIED
    assert join.open == {} and join.orphans == {}
    # a second answer to a resolved call resolves nothing
    assert join.on_approval(answer(p1, "deny"), 2) == []


@pytest.mark.parametrize(("approval_kw", "reason"), [
    ({"decision": "approve", "hmac_value": "0" * 64}, Reason.APPROVAL_MISMATCH),  # bound to other args
    ({"decision": "approve", "hmac_value": ""}, Reason.APPROVAL_MISMATCH),
    ({"decision": "approve", "at": 20_000}, Reason.APPROVAL_EXPIRED),  # answered after the deadline
    ({"decision": "deny"}, Reason.APPROVAL_DENIED),
    ({"decision": "maybe"}, Reason.APPROVAL_DENIED),
])
def test_answers_that_refuse(approval_kw, reason) -> None:
    join = ApprovalJoin(orphan_ttl_ms=1000)
    p = pending_call()
    join.add_pending(p, 0)
    [resolution] = join.on_approval(answer(p, **approval_kw), 0)
    assert isinstance(resolution, Refused) and resolution.reason is reason


def test_expiry_is_a_marker_and_the_log_order_decides() -> None:
    join = ApprovalJoin(orphan_ttl_ms=1000)
    p = pending_call(expires_at=10_000)
    join.add_pending(p, 0)
    assert join.due(9_999) == []
    assert join.due(10_000) == [p]
    assert join.due(11_000) == []  # one marker per call
    # an answer the log placed before the marker wins; the marker is then stale
    [granted] = join.on_approval(answer(p, "approve", at=9_000), 0)
    assert isinstance(granted, Granted)
    assert join.on_approval(expire_marker(p, 10_000), 1) == []
    assert join.orphans == {}
    # otherwise the marker expires the call
    q = pending_call("c2")
    join.add_pending(q, 1)
    [expired] = join.on_approval(expire_marker(q, 10_000), 2)
    assert isinstance(expired, Refused) and expired.reason is Reason.APPROVAL_EXPIRED


def test_replay_offsets_cover_answers_of_later_pendings() -> None:
    join = ApprovalJoin(orphan_ttl_ms=1000)
    p1, p2 = pending_call("c1"), pending_call("c2")
    join.add_pending(p1, 10)
    join.add_pending(p2, 11)
    join.on_approval(answer(p2, "approve"), 5)
    # replaying pending from 10 must also replay approval 5, or c2 would reopen
    assert join.replay_from(12, 6) == (10, 5)
    join.on_approval(answer(p1, "deny"), 6)
    assert join.replay_from(12, 7) == (12, 7)


# ------------------------------------------------------------------ the processor


class Feed:
    """Turns records into real ConsumerRecords on one partition, with running offsets."""

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.log: list[ConsumerRecord] = []

    def record(self, topic: str, value, ts: int, key: bytes = b"run-1") -> ConsumerRecord:
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        data = encode(value) if not isinstance(value, bytes) else value
        rec = ConsumerRecord(topic, 0, offset, ts, 0, key, data, None, len(key), len(data), [])
        self.log.append(rec)
        return rec


def outputs_by_topic(outputs):
    result: dict[str, list] = {}
    for o in outputs:
        result.setdefault(o.topic, []).append(decode(o.value))
    return result


def new_processor(validator) -> ValidatorProcessor:
    return ValidatorProcessor(validator, TOPICS, KEY, KID, run_state_ttl_ms=3_600_000)


def test_processor_signs_approved_and_routes_rejections(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    good = item("write_file", {"path": "src/a.py", "content": "hello"})
    bad = item("write_file", {"path": "../../etc/passwd", "content": "x"})
    out = outputs_by_topic(proc.process([feed.record(TOPICS.items, good, 1000), feed.record(TOPICS.items, bad, 1001)]))
    [approved] = out[TOPICS.calls_approved]
    assert isinstance(approved, ApprovedCall) and approved.call_id == good.call_id
    verify(approved, {KID: KEY})  # signed with the configured key
    assert json.loads(approved.arguments) == {"content": "hello", "path": "src/a.py"}
    [dead] = out[TOPICS.dlq]
    assert isinstance(dead, DeadLetter) and dead.reason == Reason.PATH_ESCAPE.value and dead.call_id == bad.call_id
    audits = out[TOPICS.audit]
    assert [a.state for a in audits] == ["POLICY_APPROVED", "REJECTED"]
    for a in audits:  # sanitized: no argument content anywhere in the audit record
        assert isinstance(a, AuditRecord)
        assert "hello" not in repr(a) and "passwd" not in repr(a)
    assert "passwd" not in repr(dead)


def test_forged_or_altered_approved_call_is_refused(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    good = item("write_file", {"path": "src/a.py", "content": "hello"})
    [approved] = outputs_by_topic(proc.process([feed.record(TOPICS.items, good, 1000)]))[TOPICS.calls_approved]
    verify(approved, {KID: KEY})
    altered = [
        dataclasses.replace(approved, arguments=b'{"content":"hello","path":"../x"}'),
        dataclasses.replace(approved, tool_name="run_command"),
        dataclasses.replace(approved, workspace="/"),
        dataclasses.replace(approved, policy_version="8"),
        dataclasses.replace(approved, signature="0" * 64),
        dataclasses.replace(approved, key_id="unknown"),
    ]
    for call in altered:
        with pytest.raises(ExecutionError) as info:
            verify(call, {KID: KEY})
        assert info.value.reason is Reason.SIGNATURE_INVALID
    with pytest.raises(ExecutionError):
        verify(approved, {KID: bytes(32)})  # a different key with the same id


def test_pending_approve_flow_and_replay_recovery(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    call = item("http_request", {"method": "GET", "url": "https://example.com/x"})
    out = outputs_by_topic(proc.process([feed.record(TOPICS.items, call, 1000)]))
    [pending] = out[TOPICS.calls_pending]
    assert TOPICS.calls_approved not in out
    assert pending.why == "network_access" and pending.expires_at == 1000 + 60_000
    # the pending call comes back in on its topic; then the approval
    assert proc.process([feed.record(TOPICS.calls_pending, pending, 1001)]) == []
    metadata = proc.commit_metadata()

    # a fresh owner replays from the metadata and ends in the same state
    replay_from = json.loads(metadata)["replay"]
    rebuilt = new_processor(validator)
    rebuilt.replay([r for r in feed.log if r.offset >= replay_from[r.topic]])
    assert set(rebuilt.join.open) == {call.call_id}

    approval = answer(pending, "approve", at=2000)
    for p in (proc, rebuilt):
        out = outputs_by_topic(p.process([feed.record(TOPICS.approvals, approval, 2000)]))
        [signed] = out[TOPICS.calls_approved]
        verify(signed, {KID: KEY})
        assert signed.approved_by == "alice" and signed.arguments == pending.arguments
        feed.offsets[TOPICS.approvals] -= 1  # the same record for the second processor
    assert proc.join.open == {}


def test_pending_deny_and_expiry_through_processor(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    calls = [item("http_request", {"method": "GET", "url": f"https://example.com/{i}"}) for i in range(2)]
    pendings = [outputs_by_topic(proc.process([feed.record(TOPICS.items, c, 1000)]))[TOPICS.calls_pending][0]
                for c in calls]
    for p in pendings:
        proc.process([feed.record(TOPICS.calls_pending, p, 1001)])
    out = outputs_by_topic(proc.process([feed.record(TOPICS.approvals, answer(pendings[0], "deny"), 1500)]))
    assert out[TOPICS.dlq][0].reason == Reason.APPROVAL_DENIED.value
    assert TOPICS.calls_approved not in out
    # the deadline tick writes a marker; reading it back expires the call
    [marker_out] = proc.tick(1000 + 60_000)
    assert marker_out.topic == TOPICS.approvals and marker_out.key == b"run-1"
    assert proc.tick(1000 + 70_000) == []
    marker = decode(marker_out.value)
    out = outputs_by_topic(proc.process([feed.record(TOPICS.approvals, marker, 61_000)]))
    assert out[TOPICS.dlq][0].reason == Reason.APPROVAL_EXPIRED.value
    # a late human approval after expiry approves nothing
    out = proc.process([feed.record(TOPICS.approvals, answer(pendings[1], "approve", at=1500), 62_000)])
    assert all(o.topic != TOPICS.calls_approved for o in out)


def test_approval_voided_by_policy_version_or_tampered_pending(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    stale = pending_call("old", version="6")  # validly bound, but to a policy version no longer in force
    tampered = dataclasses.replace(pending_call("tam"), arguments=b'{"a":2}')
    for p in (stale, tampered):
        proc.process([feed.record(TOPICS.calls_pending, p, 1000)])
        out = outputs_by_topic(proc.process([feed.record(TOPICS.approvals, answer(p, "approve"), 1001)]))
        assert TOPICS.calls_approved not in out
        assert out[TOPICS.dlq][0].reason == Reason.APPROVAL_MISMATCH.value


def test_undecodable_record_is_parked_not_raised(validator) -> None:
    proc, feed = new_processor(validator), Feed()
    out = proc.process([feed.record(TOPICS.items, b"\x00garbage", 1000)])
    [dead] = [decode(o.value) for o in out]
    assert dead.reason == Reason.RECORD_UNDECODABLE.value


def test_content_correlation_is_a_full_keyed_hmac_only_when_configured(validator) -> None:
    import hashlib
    import hmac

    good = item("write_file", {"path": "src/a.py", "content": "hello"})
    plain = outputs_by_topic(new_processor(validator).process([Feed().record(TOPICS.items, good, 1000)]))
    assert [a.content_hmac for a in plain[TOPICS.audit]] == [None]  # off by default

    content_key = b"audit-correlation-key"
    proc = ValidatorProcessor(validator, TOPICS, KEY, KID, run_state_ttl_ms=3_600_000, content_key=content_key)
    out = outputs_by_topic(proc.process([Feed().record(TOPICS.items, good, 1000)]))
    [approved], [audit] = out[TOPICS.calls_approved], out[TOPICS.audit]
    expected = hmac.new(content_key, approved.arguments, hashlib.sha256).hexdigest()
    assert audit.content_hmac == expected and len(audit.content_hmac) == 64
    # keyed: the bare digest of the same content is not what is published
    assert audit.content_hmac != hashlib.sha256(approved.arguments).hexdigest()
