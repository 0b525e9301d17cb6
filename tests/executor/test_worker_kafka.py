"""The executor worker through the real broker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from callgate.signing import canonical_json
from executor.worker import ExecutorConfig, ExecutorWorker
from tests.executor.support import (
    APPEND_MARKER, KEYS, approved_call, decoded, final_ledger, markers, publish,
)

pytestmark = pytest.mark.kafka
DIGEST_KEY = b"d" * 32


def _worker(bootstrap: str, topics) -> ExecutorWorker:
    return ExecutorWorker(ExecutorConfig(bootstrap=bootstrap, topics=topics, signing_keys=KEYS,
                                         digest_key=DIGEST_KEY, executor_id="test-executor"))


async def _run_until(worker: ExecutorWorker, condition, timeout_s: float = 60.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(condition(), timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture()
def git_workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "repo"
    ws.mkdir()
    subprocess.run(["git", "init", "-q", str(ws)], check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    return ws


async def test_parallel_write_and_command_calls_in_a_git_repo(kafka_bootstrap, topics, git_workspace: Path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    # one response with parallel calls: two writes, then git add and git status
    calls = [
        approved_call(run_id=run_id, tool="write_file", args={"path": "a.txt", "content": "alpha secret\n"},
                      workspace=git_workspace),
        approved_call(run_id=run_id, tool="write_file",
                      args={"path": "src/b.txt", "content": "beta\n", "create_dirs": True}, workspace=git_workspace),
        approved_call(run_id=run_id, tool="run_command", args={"argv": ["git", "add", "--", "a.txt", "src/b.txt"]},
                      workspace=git_workspace),
        approved_call(run_id=run_id, tool="run_command", args={"argv": ["git", "status", "--porcelain"]},
                      workspace=git_workspace),
    ]
    await publish(kafka_bootstrap, topics.calls_approved, calls)

    async def all_results():
        return await decoded(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= len(calls))

    results: list = []

    async def done():
        results.extend(await all_results())

    await _run_until(_worker(kafka_bootstrap, topics), done)
    by_call = {r.call_id: r for r in results}
    assert [by_call[c.call_id].state for c in calls] == ["EXECUTED"] * 4
    # serialized per run in approval order: git add saw both files, status shows both staged
    status = by_call[calls[3].call_id]
    assert status.exit_code == 0
    assert status.output.splitlines() == [b"A  a.txt", b"A  src/b.txt"]
    assert (git_workspace / "a.txt").read_text() == "alpha secret\n"

    ledger = final_ledger(await decoded(kafka_bootstrap, topics.ledger))
    assert {cid: (e.phase, e.state) for cid, e in ledger.items()} == {
        c.call_id: ("FINISHED", "EXECUTED") for c in calls
    }
    audit = await decoded(kafka_bootstrap, topics.audit)
    assert sorted(a.call_id for a in audit) == sorted(c.call_id for c in calls)
    assert all(a.stage == "executor" and a.state == "EXECUTED" for a in audit)
    assert not any(b"alpha" in canonical_json(dataclasses.asdict(a)) for a in audit)  # sanitized


async def test_forged_and_altered_calls_are_refused(kafka_bootstrap, topics, tmp_path: Path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    forged = approved_call(run_id=run_id, tool="write_file", args={"path": "forged.txt", "content": "x"},
                           workspace=tmp_path, key=b"\x00" * 32)
    good = approved_call(run_id=run_id, tool="write_file", args={"path": "ok.txt", "content": "x"},
                         workspace=tmp_path)
    altered = dataclasses.replace(good, call_id="call-altered",
                                  arguments=canonical_json({"path": "altered.txt", "content": "x"}))
    unknown_kid = dataclasses.replace(good, call_id="call-kid", key_id="nope")
    marker = approved_call(run_id=run_id, tool="run_command", args={"argv": ["true"]}, workspace=tmp_path)
    await publish(kafka_bootstrap, topics.calls_approved, [forged, altered, unknown_kid, marker])

    results: list = []

    async def done():
        results.extend(await decoded(kafka_bootstrap, topics.results,
                                     until=lambda rs: any(r.call_id == marker.call_id for r in rs)))

    await _run_until(_worker(kafka_bootstrap, topics), done)
    assert [r.call_id for r in results] == [marker.call_id]  # nothing refused produced a result
    assert not (tmp_path / "forged.txt").exists() and not (tmp_path / "altered.txt").exists()
    dlq = await decoded(kafka_bootstrap, topics.dlq)
    assert sorted((d.call_id, d.reason, d.state) for d in dlq) == sorted(
        (c.call_id, "signature_invalid", "REJECTED") for c in (forged, altered, unknown_kid)
    )
    ledger = await decoded(kafka_bootstrap, topics.ledger)
    assert {e.call_id for e in ledger} == {marker.call_id}  # refused calls never reach the ledger


async def test_duplicate_delivery_runs_once_also_across_a_restart(kafka_bootstrap, topics, tmp_path: Path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    call = approved_call(run_id=run_id, tool="run_command",
                         args={"argv": [sys.executable, APPEND_MARKER, "markers.txt", "once"]}, workspace=tmp_path)
    fence = approved_call(run_id=run_id, tool="run_command", args={"argv": ["true"]}, workspace=tmp_path)
    await publish(kafka_bootstrap, topics.calls_approved, [call, call, fence])

    async def saw(call_id):
        async def condition():
            await decoded(kafka_bootstrap, topics.results, until=lambda rs: any(r.call_id == call_id for r in rs))
        return condition

    await _run_until(_worker(kafka_bootstrap, topics), await saw(fence.call_id))
    # a new worker (restored from the ledger) gets the same call again
    fence2 = approved_call(run_id=run_id, tool="run_command", args={"argv": ["true"]}, workspace=tmp_path)
    await publish(kafka_bootstrap, topics.calls_approved, [call, fence2])
    await _run_until(_worker(kafka_bootstrap, topics), await saw(fence2.call_id))

    assert markers(tmp_path / "markers.txt") == {"once": 1}
    results = await decoded(kafka_bootstrap, topics.results)
    assert [r.call_id for r in results].count(call.call_id) == 1


async def test_started_without_finished_is_reconciled_not_rerun(kafka_bootstrap, topics, tmp_path: Path):
    """Simulate the crash window by writing STARTED entries, as a killed executor leaves them."""
    from callgate import avro
    from callgate.kafka import make_producer
    from executor import ledger

    run_id = f"run-{uuid.uuid4().hex[:8]}"
    written = approved_call(run_id=run_id, tool="write_file", args={"path": "w.txt", "content": "done"},
                            workspace=tmp_path)
    unwritten = approved_call(run_id=run_id, tool="write_file", args={"path": "u.txt", "content": "never"},
                              workspace=tmp_path)
    command = approved_call(run_id=run_id, tool="run_command",
                            args={"argv": [sys.executable, APPEND_MARKER, "m.txt", "cmd"]}, workspace=tmp_path)
    reader = approved_call(run_id=run_id, tool="read_file", args={"path": "w.txt"}, workspace=tmp_path)
    (tmp_path / "w.txt").write_text("done")  # the crashed run got this far
    # the ledger partition of the run is the approved partition of the run: produce both keyed by run id
    producer = await make_producer(kafka_bootstrap)
    try:
        meta = await producer.send_and_wait(topics.calls_approved, b"\x00junk", key=run_id.encode())
        for c in (written, unwritten, command, reader):
            args = json.loads(c.arguments)
            entry = ledger.started(call_id=c.call_id, run_id=run_id, tool_name=c.tool_name, now_ms=1,
                                   executor_id="dead", digest=ledger.intent_digest(c.tool_name, args, DIGEST_KEY))
            await producer.send_and_wait(topics.ledger, avro.encode(entry), key=c.call_id.encode(),
                                         partition=meta.partition)
    finally:
        await producer.stop()
    calls = [written, unwritten, command, reader]
    await publish(kafka_bootstrap, topics.calls_approved, calls)

    results: list = []

    async def done():
        results.extend(await decoded(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 4))

    await _run_until(_worker(kafka_bootstrap, topics), done)
    states = {r.call_id: (r.state, r.error_class) for r in results}
    assert states == {
        written.call_id: ("EXECUTED", None),
        unwritten.call_id: ("IN_DOUBT", "in_doubt"),
        command.call_id: ("IN_DOUBT", "in_doubt"),
        reader.call_id: ("FAILED", "interrupted"),
    }
    assert not (tmp_path / "u.txt").exists() and not (tmp_path / "m.txt").exists()  # nothing re-run
    dlq = await decoded(kafka_bootstrap, topics.dlq)
    assert sorted((d.call_id, d.reason) for d in dlq if d.call_id) == sorted(
        [(unwritten.call_id, "in_doubt"), (command.call_id, "in_doubt")]
    )
    assert [d.reason for d in dlq if d.call_id is None] == ["record_undecodable"]  # the junk record
    final = final_ledger(await decoded(kafka_bootstrap, topics.ledger))
    assert {cid: e.phase for cid, e in final.items()} == {
        written.call_id: "FINISHED", unwritten.call_id: "IN_DOUBT", command.call_id: "IN_DOUBT",
        reader.call_id: "FINISHED",
    }


async def test_ledger_show_cli(kafka_bootstrap, topics, tmp_path: Path):
    import os

    from tests.executor.support import topics_env

    call = approved_call(run_id="run-cli", tool="list_dir", args={"path": "."}, workspace=tmp_path)
    await publish(kafka_bootstrap, topics.calls_approved, [call])

    async def done():
        await decoded(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 1)

    await _run_until(_worker(kafka_bootstrap, topics), done)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CALLGATE_")},
           **topics_env(kafka_bootstrap, topics)}
    shown = subprocess.run([sys.executable, "-m", "callgate.cli", "ledger", "show", call.call_id], env=env,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    phases = [json.loads(line)["phase"] for line in shown.stdout.splitlines()]
    assert phases == ["STARTED", "FINISHED"]
    missing = subprocess.run([sys.executable, "-m", "callgate.cli", "ledger", "show", "no-such-call"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == ""
