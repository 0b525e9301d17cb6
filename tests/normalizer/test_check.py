"""`callgate check` over every shipped fixture: the expectations files are the contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from normalizer.check import DEFAULT_POLICY, DEFAULT_TOOLS, load_validator, run_check

from tests.normalizer.support import REPO, expect_files, load_expect

VALIDATOR = load_validator(DEFAULT_TOOLS, DEFAULT_POLICY)
ROUTES = {"openai-responses", "anthropic-messages", "openai-chat"}


def test_every_route_has_every_case() -> None:
    by_route: dict[str, set[str]] = {}
    for path in expect_files():
        by_route.setdefault(path.parent.name, set()).add(path.name)
    assert set(by_route) == ROUTES
    cases = by_route["openai-responses"]
    assert all(names == cases for names in by_route.values()) and len(cases) >= 17


@pytest.mark.parametrize("chunk_size", [0, 7])
@pytest.mark.parametrize("path", expect_files(), ids=lambda p: f"{p.parent.name}/{p.name.split('.')[0]}")
def test_fixture_decisions_match_expectations(path, chunk_size) -> None:
    expect = load_expect(path)
    rows = run_check([path.parent / a for a in expect["attempts"]], route=expect["route"], validator=VALIDATOR,
                     tool_set=expect["tool_set"], policy_id=expect["policy_id"], chunk_size=chunk_size)
    got = [(r["item_id"], r["tool"], r["state"], r["reason"]) for r in rows]
    want = [(i["item_id"], i["tool"], i["state"], i["reason"]) for i in expect["items"]]
    assert got == want
    attempts = [r["attempt_id"] for r in rows]
    for row, item in zip(rows, expect["items"]):
        assert row["attempt_id"].startswith(f"att-{item.get('attempt', 1)}-")
    assert len(set(r["call_id"] for r in rows)) == len(rows)
    assert len(attempts) == len(want)


def test_cli_prints_one_line_per_item_without_arguments() -> None:
    folder = REPO / "fixtures" / "openai-responses"
    proc = subprocess.run(
        [sys.executable, "-m", "callgate.cli", "check", str(folder / "disconnect_retry.attempt1.sse"),
         str(folder / "disconnect_retry.attempt2.sse"), "--route", "openai-responses"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["state"], r["reason"]) for r in rows] == [
        ("QUARANTINED", "stream_ended_before_terminal"), ("POLICY_APPROVED", None)]
    assert {"run_id", "attempt_id", "response_id", "item_id", "call_id", "tool", "bytes"} <= set(rows[0])
    assert "a.txt" not in proc.stdout and "fresh" not in proc.stdout
    assert rows[1]["bytes"] == len('{"path": "a.txt", "content": "fresh"}')


def test_cli_exits_zero_on_rejections_and_reports_unreadable_input() -> None:
    bad = REPO / "fixtures" / "openai-chat" / "denied_git_option.sse"
    ok = subprocess.run([sys.executable, "-m", "callgate.cli", "check", str(bad), "--route", "openai-chat"],
                        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "REJECTED"
    missing = subprocess.run([sys.executable, "-m", "callgate.cli", "check", "/nonexistent.sse", "--route",
                              "openai-chat"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert missing.returncode == 2
