"""Metrics: the helpers against the registry, and a real validator scraped over HTTP."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from callgate import metrics
from callgate.avro import encode
from callgate.kafka import make_producer
from callgate.settings import Settings

from tests.validator.helpers import item, worker_settings

KEY_HEX = "22" * 32


def sample(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# ---------------------------------------------------------------- helpers, no broker


def test_record_event_and_decision_count_by_stage_state_and_reason() -> None:
    before_in = sample("callgate_events_in_total", stage="normalizer")
    before = sample("callgate_items_total", stage="normalizer", state="QUARANTINED", reason="item_too_large")
    metrics.record_event("normalizer")
    metrics.record_event("normalizer", 4)
    metrics.record_decision("normalizer", "QUARANTINED", "item_too_large")
    assert sample("callgate_events_in_total", stage="normalizer") == before_in + 5
    assert sample("callgate_items_total", stage="normalizer", state="QUARANTINED",
                  reason="item_too_large") == before + 1


def test_labels_outside_the_closed_sets_collapse_to_other() -> None:
    before = sample("callgate_items_total", stage="ingest", state="other", reason="other")
    metrics.record_decision("ingest", "response.output_item.done", "tool:rm -rf /")
    assert sample("callgate_items_total", stage="ingest", state="other", reason="other") == before + 1
    assert sample("callgate_items_total", stage="ingest", state="EXECUTED", reason="none") >= 0
    metrics.record_decision("ingest", "EXECUTED", None)
    assert sample("callgate_items_total", stage="ingest", state="EXECUTED", reason="none") >= 1
    with pytest.raises(ValueError):
        metrics.record_event("write_file")  # a stage label is one of four names, never a tool


def test_unknown_event_routes_are_slugs_else_other() -> None:
    before = sample("callgate_unknown_events_total", route="openai-chat")
    before_other = sample("callgate_unknown_events_total", route="other")
    metrics.record_unknown_event("openai-chat", 3)
    metrics.record_unknown_event("Response.Weird Event {x}")
    metrics.record_unknown_event(None)
    assert sample("callgate_unknown_events_total", route="openai-chat") == before + 3
    assert sample("callgate_unknown_events_total", route="other") == before_other + 2


def test_decision_latency_is_seconds_from_terminal_event_clamped_at_zero() -> None:
    count = sample("callgate_decision_latency_seconds_count", stage="validator")
    total = sample("callgate_decision_latency_seconds_sum", stage="validator")
    fast = sample("callgate_decision_latency_seconds_bucket", stage="validator", le="0.25")
    assert metrics.observe_decision_latency("validator", 10_000, 10_200) == pytest.approx(0.2)
    assert metrics.observe_decision_latency("validator", 10_000, 9_000) == 0.0  # producer clock ahead
    assert sample("callgate_decision_latency_seconds_count", stage="validator") == count + 2
    assert sample("callgate_decision_latency_seconds_sum", stage="validator") == pytest.approx(total + 0.2)
    assert sample("callgate_decision_latency_seconds_bucket", stage="validator", le="0.25") == fast + 2


def test_start_metrics_serves_over_http_logs_the_port_and_stops() -> None:
    assert metrics.start_metrics(Settings(metrics_port=None), "ingest") is None
    port = metrics.start_metrics(Settings(metrics_port=0), "ingest")
    assert port and port in metrics.serving_ports("ingest")
    try:
        metrics.record_event("ingest")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert parse(text)[("callgate_events_in_total", frozenset({("stage", "ingest")}))] >= 1
    finally:
        metrics.stop_metrics(port)
    assert port not in metrics.serving_ports()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_stage_is_inferred_from_a_group_id() -> None:
    assert metrics.stage_of("t1234-validator") == "validator"
    assert metrics.stage_of("callgate.executor") == "executor"
    assert metrics.stage_of("some-group") is None


# ---------------------------------------------------------------- a real validator, scraped


async def _scrape_until(client: httpx.AsyncClient, port: int, ready, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        if ready(parse(text)):
            return text
        if time.monotonic() > deadline:
            raise TimeoutError("metrics never reached the expected values:\n" + text)
        await asyncio.sleep(0.1)  # poll the endpoint under the deadline


@pytest.mark.kafka
async def test_validator_endpoint_counts_decisions_latency_and_lag(kafka_bootstrap, topics, tmp_path) -> None:
    from validator.worker import run_validator

    settings = worker_settings(kafka_bootstrap, topics.namespace, tmp_path, KEY_HEX, metrics_port=0)
    canary = f"CANARY{uuid.uuid4().hex}"
    now = metrics.wall_clock_ms()
    good = item("write_file", {"path": "src/canary.py", "content": canary}, run_id=f"run-{uuid.uuid4().hex}",
                terminal_at=now)
    bad = item("write_file", f'{{"path":"x.txt","content":"{canary}"}} {{"path":"b"}}'.encode(),
               run_id=f"run-{uuid.uuid4().hex}", terminal_at=now)

    def items(state: str, reason: str) -> tuple[str, frozenset]:
        return ("callgate_items_total", frozenset({("stage", "validator"), ("state", state), ("reason", reason)}))

    # the registry is process-wide: other tests may have counted validator decisions already
    base_approved = sample("callgate_items_total", stage="validator", state="POLICY_APPROVED", reason="none")
    base_trailing = sample("callgate_items_total", stage="validator", state="REJECTED", reason="trailing_data")
    base_events = sample("callgate_events_in_total", stage="validator")
    base_latency = sample("callgate_decision_latency_seconds_count", stage="validator")
    # earlier tests in the session may have observed any latency: compare each series with its own start
    base_le_60 = sample("callgate_decision_latency_seconds_bucket", stage="validator", le="60.0")

    producer = await make_producer(kafka_bootstrap)
    try:
        for it in (good, bad):
            await producer.send_and_wait(topics.items, encode(it), key=it.run_id.encode())
    finally:
        await producer.stop()

    stop = asyncio.Event()
    worker = asyncio.create_task(run_validator(settings, stop))
    try:
        deadline = time.monotonic() + 30
        while not metrics.serving_ports("validator"):
            assert not worker.done(), worker.exception()
            assert time.monotonic() < deadline, "the validator never served /metrics"
            await asyncio.sleep(0.05)  # the endpoint starts with the worker task
        (port,) = metrics.serving_ports("validator")
        items_tps = {
            (frozenset({("stage", "validator"), ("topic", topics.items), ("partition", str(p))}))
            for p in range(3)
        }

        def settled(m: dict) -> bool:
            lag = {labels: v for (name, labels), v in m.items() if name == "callgate_consumer_lag_records"}
            return (
                m.get(items("POLICY_APPROVED", "none"), 0) >= base_approved + 1
                and m.get(items("REJECTED", "trailing_data"), 0) >= base_trailing + 1
                and items_tps <= set(lag)
                and all(lag[labels] == 0 for labels in items_tps)
            )

        async with httpx.AsyncClient(timeout=5) as client:
            text = await _scrape_until(client, port, settled, timeout_s=90)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)

    scraped = parse(text)
    assert scraped[items("POLICY_APPROVED", "none")] == base_approved + 1
    assert scraped[items("REJECTED", "trailing_data")] == base_trailing + 1
    assert scraped[("callgate_events_in_total", frozenset({("stage", "validator")}))] >= base_events + 2
    latency_count = ("callgate_decision_latency_seconds_count", frozenset({("stage", "validator")}))
    assert scraped[latency_count] == base_latency + 2
    # the items were written just before the worker started: well under a minute, so not in +Inf only
    le_60 = ("callgate_decision_latency_seconds_bucket", frozenset({("stage", "validator"), ("le", "60.0")}))
    assert scraped[le_60] == base_le_60 + 2
    # lag series for every owned input partition, and the stage's labels are closed sets
    lag_topics = {dict(labels)["topic"] for (name, labels) in scraped if name == "callgate_consumer_lag_records"
                  and dict(labels)["stage"] == "validator"}
    assert {topics.items, topics.calls_pending, topics.approvals} <= lag_topics
    for (name, labels) in scraped:
        if name.startswith("callgate_items_total"):
            assert dict(labels)["stage"] in metrics.STAGES
    # no content anywhere: not the arguments, not the tool name as a label, not an id
    assert canary not in text
    assert good.call_id not in text and bad.call_id not in text and good.run_id not in text
    assert "write_file" not in text
    # the worker stopped its endpoint and dropped its lag series
    assert port not in metrics.serving_ports()
    assert not any(topics.items == dict(labels).get("topic") for (name, labels) in parse(
        generate_latest(metrics.REGISTRY).decode()) if name == "callgate_consumer_lag_records")
