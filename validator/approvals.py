"""Human approval: binding, and the join of pending calls with answers (pure).

A pending call's `args_hmac` is a keyed HMAC over its identity, tool,
canonical arguments and policy id + version, so an answer binds to exactly
the arguments the person saw under exactly that policy: an approval for
args X never authorises args Y, and a policy change voids open approvals.

`ApprovalJoin` holds open pending calls and answers that arrived before their
pending call (both topics are keyed by run id, so one validator partition
owner sees both, but in no guaranteed order across the two topics). Every
resolution is driven by a *record* (an Approval with decision approve, deny
or expire), never by a clock: the validator's deadline writes an `expire`
marker to the approvals topic, and the call expires when that marker is
read back, after any answer that the log placed before it. So replaying the
same records rebuilds exactly the same state, which is how the worker
recovers (see validator/worker.py).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from hashlib import sha256

from callgate.errors import Reason
from callgate.records import Approval, PendingCall
from callgate.signing import canonical_json

APPROVE = "approve"
DENY = "deny"
EXPIRE = "expire"
VALIDATOR_PRINCIPAL = "validator"


def args_hmac(
    key: bytes, *, call_id: str, tool_name: str, arguments: bytes, policy_id: str, policy_version: str
) -> str:
    content = canonical_json(
        {
            "call_id": call_id,
            "tool_name": tool_name,
            "arguments": arguments.decode("utf-8"),
            "policy_id": policy_id,
            "policy_version": policy_version,
        }
    )
    return hmac.new(key, content, sha256).hexdigest()


def pending_hmac_ok(key: bytes, pending: PendingCall) -> bool:
    try:
        expected = args_hmac(
            key, call_id=pending.call_id, tool_name=pending.tool_name, arguments=pending.arguments,
            policy_id=pending.policy_id, policy_version=pending.policy_version,
        )
    except UnicodeDecodeError:
        return False
    return hmac.compare_digest(expected, pending.args_hmac)


@dataclass(frozen=True, slots=True)
class Granted:
    pending: PendingCall
    approval: Approval


@dataclass(frozen=True, slots=True)
class Refused:
    pending: PendingCall
    reason: Reason
    detail_code: str | None
    approval: Approval


Resolution = Granted | Refused


@dataclass(slots=True)
class _Open:
    pending: PendingCall
    offset: int  # in the pending topic partition


@dataclass(slots=True)
class _Orphan:
    approval: Approval
    offset: int  # in the approvals topic partition


@dataclass(slots=True)
class ApprovalJoin:
    orphan_ttl_ms: int
    open: dict[str, _Open] = field(default_factory=dict)
    orphans: dict[str, _Orphan] = field(default_factory=dict)
    # (pending offset, approval offset) of resolved calls still after the oldest open
    # pending: replaying the pending topic from there must also replay these answers
    resolved_log: list[tuple[int, int]] = field(default_factory=list)
    expiry_requested: set[str] = field(default_factory=set)  # local only, not replayed

    def add_pending(self, pending: PendingCall, offset: int) -> list[Resolution]:
        if pending.call_id in self.open:
            return []  # the same pending twice: first wins
        self.open[pending.call_id] = _Open(pending, offset)
        orphan = self.orphans.pop(pending.call_id, None)
        if orphan is None:
            return []
        return self.on_approval(orphan.approval, orphan.offset)

    def on_approval(self, approval: Approval, offset: int) -> list[Resolution]:
        entry = self.open.get(approval.call_id)
        if entry is None:
            # markers are only written for open calls: one for a closed call is stale
            if approval.decision != EXPIRE and approval.call_id not in self.orphans:
                self.orphans[approval.call_id] = _Orphan(approval, offset)
            return []
        del self.open[approval.call_id]
        self.expiry_requested.discard(approval.call_id)
        self.resolved_log.append((entry.offset, offset))
        self._prune()
        return [judge(entry.pending, approval)]

    def due(self, now_ms: int) -> list[PendingCall]:
        """Open calls past their deadline whose expire marker was not yet written."""
        due = [
            e.pending for cid, e in self.open.items()
            if e.pending.expires_at <= now_ms and cid not in self.expiry_requested
        ]
        self.expiry_requested.update(p.call_id for p in due)
        return due

    def evict_orphans(self, stream_time_ms: int) -> int:
        stale = [cid for cid, o in self.orphans.items() if o.approval.decided_at + self.orphan_ttl_ms < stream_time_ms]
        for cid in stale:
            del self.orphans[cid]
        return len(stale)

    def _prune(self) -> None:
        oldest = min((e.offset for e in self.open.values()), default=None)
        if oldest is None:
            self.resolved_log.clear()
        else:
            self.resolved_log = [r for r in self.resolved_log if r[0] >= oldest]

    def replay_from(self, pending_next: int, approvals_next: int) -> tuple[int, int]:
        """Offsets from which replaying the two topics rebuilds this state."""
        pending_start = min((e.offset for e in self.open.values()), default=pending_next)
        approval_offsets = [o.offset for o in self.orphans.values()]
        approval_offsets += [a for p, a in self.resolved_log if p >= pending_start]
        return pending_start, min(approval_offsets, default=approvals_next)


def expire_marker(pending: PendingCall, now_ms: int) -> Approval:
    return Approval(
        call_id=pending.call_id, decision=EXPIRE, decided_by=VALIDATOR_PRINCIPAL, decided_at=now_ms,
        why="deadline", run_id=pending.run_id, args_hmac=pending.args_hmac,
    )


def judge(pending: PendingCall, approval: Approval) -> Resolution:
    if approval.decision == EXPIRE:
        return Refused(pending, Reason.APPROVAL_EXPIRED, "deadline", approval)
    if approval.args_hmac is None or not hmac.compare_digest(approval.args_hmac, pending.args_hmac):
        return Refused(pending, Reason.APPROVAL_MISMATCH, "args_hmac", approval)
    if approval.decided_at > pending.expires_at:
        return Refused(pending, Reason.APPROVAL_EXPIRED, "answered_late", approval)
    if approval.decision == APPROVE:
        return Granted(pending, approval)
    if approval.decision == DENY:
        return Refused(pending, Reason.APPROVAL_DENIED, "denied", approval)
    return Refused(pending, Reason.APPROVAL_DENIED, "unknown_decision", approval)
