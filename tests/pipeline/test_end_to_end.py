"""The whole pipeline through the real broker: the demo's runs, and a canary that must never leak.

Both start the four workers as real processes against a real local upstream,
exactly as `dev/demo` does.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest

from callgate import avro
from callgate.demo import run_demo
from callgate.kafka import read_topic
from callgate.pipeline import ExpectedItem, Pipeline, RunSpec

pytestmark = pytest.mark.kafka


async def test_every_shipped_fixture_ends_as_expected(kafka_bootstrap, tmp_path, capsys):
    status = await run_demo(kafka_bootstrap, tmp_path / "demo", timeout_s=150)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "every item ended as its fixture expects" in out
    assert re.search(r"EXECUTED \d+", out) and re.search(r"QUARANTINED \d+", out) and re.search(r"REJECTED \d+", out)


def _sse(events: list[tuple[str, dict]]) -> str:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


def _responses_call(item_id: str, name: str, argument_chunks: list[str], *, done: bool = True) -> list[tuple[str, dict]]:
    events = [
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0, "item": {
            "type": "function_call", "id": item_id, "call_id": f"call_{item_id}", "name": name, "arguments": ""}}),
    ]
    events += [
        ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                    "item_id": item_id, "output_index": 0, "delta": chunk})
        for chunk in argument_chunks
    ]
    if done:
        events.append(("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": {
            "type": "function_call", "id": item_id, "call_id": f"call_{item_id}", "name": name,
            "arguments": "".join(argument_chunks), "status": "completed"}}))
    return events


def _response(events: list[tuple[str, dict]], *, complete: bool = True) -> str:
    head = [("response.created", {"type": "response.created", "response": {"id": "resp_canary", "status": "in_progress"}})]
    tail = [("response.completed", {"type": "response.completed", "response": {"id": "resp_canary", "status": "completed"}})]
    return _sse(head + events + (tail if complete else []))


def _metrics_ports(logs: str) -> list[int]:
    ports = []
    for line in logs.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "metrics" in str(record.get("event", "")) and "port" in record:
            ports.append(int(record["port"]))
    return ports


async def test_a_canary_secret_reaches_no_log_audit_dlq_or_metric(kafka_bootstrap, tmp_path):
    canary = f"CANARY{uuid.uuid4().hex}"
    fixtures = tmp_path / "fixtures" / "openai-responses"
    fixtures.mkdir(parents=True)
    # tool arguments carrying the canary: one approved and executed, one malformed, one cut before its terminal
    (fixtures / "good.sse").write_text(_response(
        _responses_call("fc_w", "write_file", ['{"path": "canary.txt", ', f'"content": "{canary}"}}'])
        + _responses_call("fc_r", "read_file", ['{"path": "secret-notes.txt"}'])
    ))
    (fixtures / "bad.sse").write_text(_response(
        _responses_call("fc_b", "write_file", [f'{{"path": "x.txt", "content": "{canary}"', "} trailing"])
    ))
    (fixtures / "cut.sse").write_text(_response(
        _responses_call("fc_c", "write_file", [f'{{"path": "y.txt", "content": "{canary}"'], done=False),
        complete=False,
    ))
    tools = ("write_file", "read_file")
    specs = [
        RunSpec("canary/good", "openai-responses", ("openai-responses/good.sse",), tools, "demo",
                (ExpectedItem("EXECUTED", None), ExpectedItem("EXECUTED", None))),
        RunSpec("canary/bad", "openai-responses", ("openai-responses/bad.sse",), tools, "demo",
                (ExpectedItem("REJECTED", "trailing_data"),)),
        RunSpec("canary/cut", "openai-responses", ("openai-responses/cut.sse",), tools, "demo",
                (ExpectedItem("QUARANTINED", None),)),
    ]
    pipeline = Pipeline(bootstrap=kafka_bootstrap, work_dir=tmp_path / "work", fixtures_root=tmp_path / "fixtures",
                        extra_env={"CALLGATE_METRICS_PORT": "0"})
    async with pipeline:
        # file contents carrying the canary, read by the executor
        (tmp_path / "work" / "workspaces" / "demo" / "secret-notes.txt").write_text(f"notes {canary}\n")
        for spec in specs:
            await pipeline.submit(spec)
        outcomes = await pipeline.settle(timeout_s=120)
        finals = {o.spec.label: [o.final_of(i)[0] for i in o.timeline.items] for o in outcomes}
        assert finals == {"canary/good": ["EXECUTED", "EXECUTED"], "canary/bad": ["REJECTED"],
                          "canary/cut": ["QUARANTINED"]}
        logs = "".join(w.logs() for w in pipeline.fleet.workers)
        scraped = ""
        async with httpx.AsyncClient(timeout=5) as client:
            for port in _metrics_ports(logs):
                scraped += (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        audit = await read_topic(kafka_bootstrap, pipeline.topics.audit)
        dlq = await read_topic(kafka_bootstrap, pipeline.topics.dlq)
        raw = await read_topic(kafka_bootstrap, pipeline.topics.sse_raw)

    assert (tmp_path / "work" / "workspaces" / "demo" / "canary.txt").read_text() == canary
    assert any(canary.encode() in r.value for r in raw)  # the restricted topic does carry it: the check can fail
    assert logs and canary not in logs
    assert audit and not any(canary.encode() in r.value for r in audit)
    assert dlq and not any(canary.encode() in r.value for r in dlq)
    decoded = [avro.decode(r.value) for r in audit]
    assert canary not in json.dumps([r.__repr__() for r in decoded])
    assert "callgate_items_total" in scraped  # the endpoints answered, so the check below means something
    assert canary not in scraped
