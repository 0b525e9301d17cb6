"""SIGKILL the executor at random points, restart it, and check conservation.

Real executions are counted on disk, from outside the executor: every
write_file ends with exactly one rename onto its per-call target (counted with
inotify), every run_command appends its call's marker to a file. Then:
- each call executed at most once;
- each call has exactly one result, and ends EXECUTED, FAILED or IN_DOUBT in
  the results, the ledger and (for IN_DOUBT) the dead-letter topic alike;
- write_file is EXECUTED exactly when its rename happened (reconcile proves the
  ones a kill interrupted), IN_DOUBT exactly when it did not.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.executor.support import (
    APPEND_MARKER, RenameCounter, approved_call, decoded, final_ledger, markers, publish, topics_env,
)

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]


def _start_executor(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "callgate.cli", "executor", "--instance-id", "crash-0",
             "--session-timeout-ms", "6000"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )


async def _crash_run(kafka_bootstrap, topics, tmp_path: Path, n_calls: int, n_kills: int, seed: int) -> None:
    rng = random.Random(seed)
    ws = tmp_path / "ws"
    (ws / "w").mkdir(parents=True)
    runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(10)]
    calls = []
    for i in range(n_calls):
        run_id = runs[i % len(runs)]
        call_id = f"call-{i:04d}-{uuid.uuid4().hex[:6]}"
        if rng.random() < 0.2:
            args = {"argv": [sys.executable, APPEND_MARKER, "markers.txt", call_id, str(rng.choice([0.05, 0.2]))]}
            calls.append(approved_call(run_id=run_id, tool="run_command", args=args, workspace=ws, call_id=call_id))
        else:
            args = {"path": f"w/{call_id}.txt", "content": f"marker {call_id}\n"}
            calls.append(approved_call(run_id=run_id, tool="write_file", args=args, workspace=ws, call_id=call_id))
    renames = RenameCounter(ws / "w")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CALLGATE_")},
           **topics_env(kafka_bootstrap, topics)}
    log_path = tmp_path / "executor.log"

    async def feed() -> None:
        # approved calls keep arriving while the executor is being killed, so kills land mid-work
        wave = max(1, n_calls // (n_kills * 2))
        for start in range(0, n_calls, wave):
            await publish(kafka_bootstrap, topics.calls_approved, calls[start : start + wave])
            await asyncio.sleep(1.0)

    feeder = asyncio.create_task(feed())
    proc = _start_executor(env, log_path)
    kills = 0
    try:
        while kills < n_kills:
            await asyncio.sleep(rng.uniform(0.8, 3.0))  # the chaos: a random moment, not a synchronisation
            if feeder.done() and len(await decoded(kafka_bootstrap, topics.results)) >= n_calls:
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            proc = _start_executor(env, log_path)
        await feeder
        results = await decoded(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= n_calls,
                                timeout_s=180)
    finally:
        feeder.cancel()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        renames.drain()
        renames.close()

    assert kills >= max(3, n_kills // 2), f"only {kills} kills happened before the work finished"
    assert not renames.overflowed
    by_call: dict = {}
    for r in results:
        assert r.call_id not in by_call, "a call has two results"
        by_call[r.call_id] = r
    assert set(by_call) == {c.call_id for c in calls}
    appended = markers(ws / "markers.txt")
    ledger = final_ledger(await decoded(kafka_bootstrap, topics.ledger))
    dlq = {d.call_id: d for d in await decoded(kafka_bootstrap, topics.dlq)}
    outcome = {"EXECUTED": 0, "FAILED": 0, "IN_DOUBT": 0}
    for call in calls:
        result = by_call[call.call_id]
        assert result.state in outcome
        outcome[result.state] += 1
        entry = ledger[call.call_id]
        assert (entry.phase, entry.state) == ("IN_DOUBT" if result.state == "IN_DOUBT" else "FINISHED", result.state)
        assert (call.call_id in dlq) == (result.state == "IN_DOUBT")
        if call.tool_name == "write_file":
            executions = renames.counts[f"{call.call_id}.txt"]
            assert executions <= 1, "write_file executed twice"
            assert (executions == 1) == (result.state == "EXECUTED"), (call.call_id, executions, result.state)
            if executions:
                assert (ws / "w" / f"{call.call_id}.txt").read_text() == f"marker {call.call_id}\n"
        else:
            executions = appended[call.call_id]
            assert executions <= 1, "run_command executed twice"
            if result.state == "EXECUTED":
                assert executions == 1
            else:
                assert result.state == "IN_DOUBT" and dlq[call.call_id].reason == "in_doubt"
    assert outcome["EXECUTED"] > 0
    print(f"kills={kills} outcome={outcome}")


async def test_sigkill_at_random_points_bounded(kafka_bootstrap, topics, tmp_path: Path) -> None:
    await _crash_run(kafka_bootstrap, topics, tmp_path, n_calls=100, n_kills=10, seed=1)


@pytest.mark.slow
async def test_sigkill_at_random_points_long(kafka_bootstrap, topics, tmp_path: Path) -> None:
    await _crash_run(kafka_bootstrap, topics, tmp_path, n_calls=400, n_kills=40, seed=2)
