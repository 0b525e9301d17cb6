"""Settle a call the ledger shows STARTED but not finished, without re-running it.

Per tool:
- write_file: its effect is observable. If the target now holds exactly the
  intended content (keyed digest equal to the ledger's intent_digest), the
  write happened: EXECUTED. Otherwise it is unknown (never written, or written
  and changed since): IN_DOUBT, escalated.
- read_file, list_dir: no side effect, so nothing needs reconciling; but the
  contract is "each call runs at most once", and a re-run could return a
  different answer than the one a crashed run may already have produced. So
  they are not re-run: FAILED with reason INTERRUPTED, and the agent may ask
  again with a new call. No dead letter, since nothing in the world is unknown.
- run_command, http_request and anything else: the effect is outside our
  sight: IN_DOUBT, escalated to the dead-letter topic with Reason.IN_DOUBT.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from callgate.errors import Reason
from callgate.records import LedgerEntry
from callgate.states import ItemState
from executor.ledger import content_digest
from executor.tools import SIDE_EFFECT_FREE
from executor.tools.files import read_for_digest


@dataclass(frozen=True, slots=True)
class Reconciled:
    state: ItemState  # EXECUTED | FAILED | IN_DOUBT
    reason: Reason | None
    escalate: bool  # send to the dead-letter topic
    output: bytes = b""


def reconcile(
    tool_name: str,
    args: dict[str, Any],
    entry: LedgerEntry,
    *,
    workspace: str,
    digest_key: bytes,
    max_bytes: int = 16 * 1024 * 1024,
) -> Reconciled:
    if tool_name == "write_file":
        return _reconcile_write(args, entry, workspace, digest_key, max_bytes)
    if tool_name in SIDE_EFFECT_FREE:
        return Reconciled(ItemState.FAILED, Reason.INTERRUPTED, escalate=False)
    return Reconciled(ItemState.IN_DOUBT, Reason.IN_DOUBT, escalate=True)


def _reconcile_write(
    args: dict[str, Any], entry: LedgerEntry, workspace: str, key: bytes, max_bytes: int
) -> Reconciled:
    path = args.get("path")
    if entry.intent_digest is None or not isinstance(path, str):
        return Reconciled(ItemState.IN_DOUBT, Reason.IN_DOUBT, escalate=True)
    current = read_for_digest(workspace, path, max_bytes)
    if current is not None and hmac.compare_digest(content_digest(current, key), entry.intent_digest):
        summary = json.dumps({"bytes_written": len(current), "reconciled": True}).encode()
        return Reconciled(ItemState.EXECUTED, None, escalate=False, output=summary)
    return Reconciled(ItemState.IN_DOUBT, Reason.IN_DOUBT, escalate=True)
