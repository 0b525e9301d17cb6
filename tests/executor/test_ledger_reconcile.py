"""The ledger core and per-tool reconcile, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from callgate.errors import Reason
from callgate.signing import canonical_json
from callgate.states import ItemState
from executor import ledger
from executor.ledger import LedgerView, Phase, Reconcile, Run, Skip, decide
from executor.reconcile import reconcile
from executor.tools import ToolContext, run_tool

KEY = b"k" * 32


def _started(call_id: str = "c1", tool: str = "write_file", digest: str | None = None):
    return ledger.started(call_id=call_id, run_id="r1", tool_name=tool, now_ms=1, executor_id="e1", digest=digest)


def test_decide_run_reconcile_skip() -> None:
    view = LedgerView()
    assert decide("c1", view) == Run()
    start = _started()
    view.apply(start)
    assert decide("c1", view) == Reconcile(start)
    done = ledger.settled(start, ItemState.EXECUTED, now_ms=2, executor_id="e1")
    view.apply(done)
    assert decide("c1", view) == Skip(done)
    assert done.phase == Phase.FINISHED and done.state == "EXECUTED"
    assert decide("c2", view) == Run()


def test_final_entries_are_never_reopened() -> None:
    view = LedgerView()
    start = _started()
    doubt = ledger.settled(start, ItemState.IN_DOUBT, now_ms=2, executor_id="e1")
    view.apply(start)
    view.apply(doubt)
    view.apply(start)  # a late or replayed STARTED
    view.apply(ledger.settled(start, ItemState.EXECUTED, now_ms=3, executor_id="e2"))
    assert view.get("c1") == doubt
    assert isinstance(decide("c1", view), Skip)


def test_settled_rejects_non_final_state() -> None:
    with pytest.raises(ValueError):
        ledger.settled(_started(), ItemState.POLICY_APPROVED, now_ms=2, executor_id="e1")


def test_intent_digest_is_keyed_and_content_free() -> None:
    args = {"path": "a.txt", "content": "secret body"}
    digest = ledger.intent_digest("write_file", args, KEY)
    assert digest is not None and "secret" not in digest and len(digest) == 64
    assert digest != ledger.intent_digest("write_file", args, b"other-key" * 4)
    assert ledger.intent_digest("run_command", {"argv": ["ls"]}, KEY) is None


def test_reconcile_write_file_matches_intended_content(tmp_path: Path) -> None:
    args = {"path": "out.txt", "content": "intended"}
    entry = _started(digest=ledger.intent_digest("write_file", args, KEY))
    # crash before the write: the target is absent -> unknown, escalate
    before = reconcile("write_file", args, entry, workspace=str(tmp_path), digest_key=KEY)
    assert (before.state, before.reason, before.escalate) == (ItemState.IN_DOUBT, Reason.IN_DOUBT, True)
    # crash after the write: the target holds exactly the intent
    assert run_tool("write_file", canonical_json(args), ToolContext(str(tmp_path))).state is ItemState.EXECUTED
    after = reconcile("write_file", args, entry, workspace=str(tmp_path), digest_key=KEY)
    assert (after.state, after.escalate) == (ItemState.EXECUTED, False)
    # changed since: unknown again
    (tmp_path / "out.txt").write_text("something else")
    changed = reconcile("write_file", args, entry, workspace=str(tmp_path), digest_key=KEY)
    assert changed.state is ItemState.IN_DOUBT and changed.escalate


def test_reconcile_write_file_without_digest_or_via_symlink(tmp_path: Path) -> None:
    args = {"path": "out.txt", "content": "intended"}
    assert reconcile("write_file", args, _started(), workspace=str(tmp_path), digest_key=KEY).escalate
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("intended")
    (tmp_path / "out.txt").symlink_to(outside)
    entry = _started(digest=ledger.intent_digest("write_file", args, KEY))
    result = reconcile("write_file", args, entry, workspace=str(tmp_path), digest_key=KEY)
    assert result.state is ItemState.IN_DOUBT  # a symlink is never read through


@pytest.mark.parametrize("tool", ["read_file", "list_dir"])
def test_reconcile_reads_fail_without_rerun(tmp_path: Path, tool: str) -> None:
    result = reconcile(tool, {"path": "."}, _started(tool=tool), workspace=str(tmp_path), digest_key=KEY)
    assert (result.state, result.reason, result.escalate) == (ItemState.FAILED, Reason.INTERRUPTED, False)


@pytest.mark.parametrize("tool", ["run_command", "http_request", "some_future_tool"])
def test_reconcile_escalates_opaque_effects(tmp_path: Path, tool: str) -> None:
    result = reconcile(tool, {}, _started(tool=tool), workspace=str(tmp_path), digest_key=KEY)
    assert (result.state, result.reason, result.escalate) == (ItemState.IN_DOUBT, Reason.IN_DOUBT, True)
