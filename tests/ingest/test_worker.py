"""Ingest against the local upstream through the real broker, one test per transport fault.

Assertions are on what a read_committed consumer sees on sse.raw, decoded with callgate.avro.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from callgate import avro
from callgate.kafka import make_producer, read_topic
from callgate.records import AttemptStarted, RawSseMessage, RunRequest, TransportEnd
from callgate.topics import TopicNames
from ingest.attempt import RetryPolicy
from ingest.decoder import SseDecoder
from ingest.upstream import LocalUpstream
from ingest.worker import IngestConfig, IngestWorker, StreamTimeouts, route_adapter_version

pytestmark = pytest.mark.kafka

FIXTURE = Path("/work/shared/fixtures-real/anthropic/anthropic-python-tool_use_response.sse")
REPO_FIXTURE = Path(__file__).resolve().parents[2] / "fixtures"
ROUTE = "anthropic-messages"
KEY_ENV = "CALLGATE_TEST_UPSTREAM_KEY"


def _fixture_bytes() -> bytes:
    if FIXTURE.exists():
        return FIXTURE.read_bytes()
    # the shipped fixtures are the fallback when the shared real ones are not mounted
    found = sorted(REPO_FIXTURE.rglob("*.sse"))
    assert found, "no SSE fixture available"
    return found[0].read_bytes()


RECORDED = _fixture_bytes()
# the recorded file ends without the blank line after message_stop (so, per spec, that last message
# is never dispatched: see test_unterminated_last_message); most tests use a well-terminated copy
WIRE = RECORDED if RECORDED.endswith(b"\n\n") else RECORDED + b"\n\n"


def expected_messages(wire: bytes = WIRE) -> list[tuple[str, str]]:
    decoder = SseDecoder()
    return [(m.event, m.data) for m in decoder.feed(wire)]


@dataclass
class Harness:
    bootstrap: str
    topics: TopicNames
    upstream: LocalUpstream
    group_id: str
    workers: list[tuple[IngestWorker, asyncio.Event, asyncio.Task[None]]]

    def config(self, **kw: Any) -> IngestConfig:
        base: dict[str, Any] = dict(
            bootstrap=self.bootstrap, topics=self.topics, group_id=self.group_id, max_concurrent_runs=4,
            timeouts=StreamTimeouts(connect_s=2.0, idle_s=1.0, total_s=20.0),
            policy=RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2),
        )
        base.update(kw)
        return IngestConfig(**base)

    def start_worker(self, **kw: Any) -> IngestWorker:
        worker = IngestWorker(self.config(**kw), env={KEY_ENV: "sk-test-not-a-secret"}, rng=random.Random(0))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        self.workers.append((worker, stop, task))
        return worker

    async def stop_worker(self, worker: IngestWorker) -> None:
        for w, stop, task in self.workers:
            if w is worker:
                stop.set()
                await asyncio.wait_for(task, 30)

    async def submit(self, url: str, run_id: str | None = None, api_key_env: str | None = KEY_ENV) -> str:
        run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
        request = RunRequest(
            run_id=run_id, route=ROUTE, model="fixture", upstream_url=url, request_body=b'{"stream":true}',
            tool_set=["write_file"], policy_id="demo", submitted_at=int(time.time() * 1000),
            api_key_env=api_key_env,
        )
        producer = await make_producer(self.bootstrap)
        try:
            await producer.send_and_wait(self.topics.runs, avro.encode(request), key=run_id.encode())
        finally:
            await producer.stop()
        return run_id

    async def records(
        self, run_id: str, until: Callable[[list[Any]], bool] | None = None, timeout_s: float = 30.0
    ) -> list[Any]:
        """This run's sse.raw records, once `until` holds (default: an attempt ended without retry)."""
        done = until or (lambda rs: any(isinstance(r, TransportEnd) and not r.will_retry for r in rs))

        def decoded(raw: list[Any]) -> list[Any]:
            # one key, one partition: the topic's order is the run's order
            return [avro.decode(r.value, topic=r.topic, partition=r.partition, offset=r.offset) for r in raw
                    if r.key == run_id.encode()]

        raw = await read_topic(self.bootstrap, self.topics.sse_raw, until=lambda rs: done(decoded(rs)),
                               timeout_s=timeout_s)
        return decoded(raw)


@pytest.fixture
async def harness(kafka_bootstrap: str, topics: TopicNames, tmp_path: Path) -> AsyncIterator[Harness]:
    (tmp_path / ROUTE).mkdir()
    (tmp_path / ROUTE / "tool.sse").write_bytes(WIRE)
    (tmp_path / ROUTE / "recorded.sse").write_bytes(RECORDED)
    async with LocalUpstream(tmp_path) as upstream:
        h = Harness(kafka_bootstrap, topics, upstream, f"{topics.namespace}-ingest", [])
        try:
            yield h
        finally:
            for _w, stop, _task in h.workers:
                stop.set()
            for _w, _stop, task in h.workers:
                await asyncio.wait_for(task, 30)


def split(records: list[Any]) -> dict[str, list[Any]]:
    by_attempt: dict[str, list[Any]] = {}
    for r in records:
        by_attempt.setdefault(r.attempt_id, []).append(r)
    return by_attempt


def assert_attempt_shape(records: list[Any]) -> tuple[AttemptStarted, list[RawSseMessage], TransportEnd]:
    """AttemptStarted first, then messages with seq 0.., then exactly one TransportEnd with seq = count."""
    start, *messages, end = records
    assert isinstance(start, AttemptStarted)
    assert isinstance(end, TransportEnd)
    assert all(isinstance(m, RawSseMessage) for m in messages)
    assert [m.seq for m in messages] == list(range(len(messages)))
    assert end.seq == len(messages) == end.messages
    assert {r.run_id for r in records} == {start.run_id}
    return start, messages, end


async def test_clean_eof(harness: Harness) -> None:
    harness.start_worker()
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse"))
    records = await harness.records(run_id)
    attempts = split(records)
    assert len(attempts) == 1
    start, messages, end = assert_attempt_shape(records)
    assert start.attempt_number == 1 and start.route == ROUTE and start.tool_set == ["write_file"]
    assert start.adapter_version == route_adapter_version(ROUTE) != "unregistered"
    assert all(m.adapter_version == start.adapter_version and m.route == ROUTE for m in messages)
    assert [(m.event, m.data) for m in messages] == expected_messages()
    assert end.reason == "transport_eof" and end.http_status == 200
    assert end.bytes_received == len(WIRE) and not end.incomplete_message and not end.will_retry
    # the key went as a header, and only there
    (request,) = harness.upstream.requests_for(f"{ROUTE}/tool.sse")
    assert request.headers["x-api-key"] == "sk-test-not-a-secret"
    assert "sk-test" not in repr(records)


async def test_unterminated_last_message(harness: Harness) -> None:
    harness.start_worker()
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/recorded.sse"))
    _, messages, end = assert_attempt_shape(await harness.records(run_id))
    decoder = SseDecoder()
    want = [(m.event, m.data) for m in decoder.feed(RECORDED)]
    assert [(m.event, m.data) for m in messages] == want
    assert end.reason == "transport_eof" and end.incomplete_message == decoder.close().incomplete


async def test_one_byte_chunks(harness: Harness) -> None:
    harness.start_worker()
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse", chunk=1))
    records = await harness.records(run_id)
    _, messages, end = assert_attempt_shape(records)
    assert [(m.event, m.data) for m in messages] == expected_messages()
    assert end.reason == "transport_eof" and end.bytes_received == len(WIRE)


def assert_fresh_second_attempt(first: list[Any], second: list[Any]) -> None:
    """The retry is a whole new attempt: new id, number 2, the full stream, nothing carried over."""
    (first_start, first_messages, _), (second_start, second_messages, second_end) = (
        assert_attempt_shape(first), assert_attempt_shape(second))
    assert second_start.attempt_id != first_start.attempt_id and second_start.attempt_number == 2
    assert [(m.event, m.data) for m in second_messages] == expected_messages()
    assert {m.attempt_id for m in second_messages} == {second_start.attempt_id}
    assert second_end.reason == "transport_eof" and not second_end.will_retry
    assert not second_end.incomplete_message and second_end.bytes_received == len(WIRE)
    assert first_messages and second_messages[0].seq == 0  # the sequence restarts, it does not continue


async def test_stall_ends_in_idle_timeout_then_a_fresh_attempt(harness: Harness) -> None:
    stall_at = WIRE.index(b"\n\n", len(WIRE) // 2) + 2 + 10  # some messages, then mid-message silence
    want = expected_messages(WIRE[:stall_at])
    harness.start_worker(timeouts=StreamTimeouts(connect_s=2.0, idle_s=0.5, total_s=20.0))
    url = harness.upstream.url(f"{ROUTE}/tool.sse", stall_after=stall_at, fault_attempts=1, key="rstall")
    run_id = await harness.submit(url)
    records = await harness.records(run_id)
    attempts = list(split(records).values())
    assert len(attempts) == 2  # retried although messages were published: attempts never mix
    _, messages, end = assert_attempt_shape(attempts[0])
    assert [(m.event, m.data) for m in messages] == want
    assert end.reason == "transport_idle_timeout" and end.incomplete_message and end.will_retry
    assert end.bytes_received == stall_at
    assert_fresh_second_attempt(attempts[0], attempts[1])


async def test_cut_mid_message_is_a_disconnect_and_the_partial_message_is_not_published(
    harness: Harness,
) -> None:
    boundary = WIRE.index(b"\n\n", len(WIRE) // 3) + 2
    cut = boundary + 20  # inside the next message
    want = expected_messages(WIRE[:cut])
    assert want == expected_messages(WIRE[:boundary])
    harness.start_worker()
    url = harness.upstream.url(f"{ROUTE}/tool.sse", cut_after=cut, fault_attempts=1, key="rcut")
    run_id = await harness.submit(url)
    records = await harness.records(run_id)
    attempts = list(split(records).values())
    assert len(attempts) == 2
    _, messages, end = assert_attempt_shape(attempts[0])
    assert [(m.event, m.data) for m in messages] == want  # the cut message was never published
    assert end.reason == "transport_disconnect" and end.incomplete_message and end.will_retry
    assert end.bytes_received == cut
    assert_fresh_second_attempt(attempts[0], attempts[1])


async def test_cut_on_every_attempt_stops_at_max_attempts(harness: Harness) -> None:
    cut = WIRE.index(b"\n\n") + 5
    harness.start_worker(policy=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.02))
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse", cut_after=cut, key="rcut2"))
    ends = [assert_attempt_shape(a)[2] for a in split(await harness.records(run_id)).values()]
    assert [(e.reason, e.will_retry, e.messages) for e in ends] == [("transport_disconnect", True, 1),
                                                                    ("transport_disconnect", False, 1)]
    assert len(harness.upstream.requests_for("rcut2")) == 2


async def test_429_then_success_is_two_attempts(harness: Harness) -> None:
    harness.start_worker()
    url = harness.upstream.url(f"{ROUTE}/tool.sse", status=429, fail_first=1, retry_after=0, key="r429")
    run_id = await harness.submit(url)
    records = await harness.records(run_id)
    attempts = list(split(records).values())
    assert len(attempts) == 2
    first_start, first_messages, first_end = assert_attempt_shape(attempts[0])
    second_start, second_messages, second_end = assert_attempt_shape(attempts[1])
    assert first_start.attempt_id != second_start.attempt_id
    assert (first_start.attempt_number, second_start.attempt_number) == (1, 2)
    assert first_messages == [] and first_end.http_status == 429 and first_end.will_retry
    assert first_end.reason == "transport_http_status"
    assert [(m.event, m.data) for m in second_messages] == expected_messages()
    assert second_end.reason == "transport_eof" and not second_end.will_retry
    assert all(m.attempt_id == second_start.attempt_id for m in second_messages)


async def test_500_until_retries_are_exhausted(harness: Harness) -> None:
    harness.start_worker(policy=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05))
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse", status=500, key="r500"))
    records = await harness.records(run_id)
    attempts = list(split(records).values())
    assert len(attempts) == 3
    ends = [assert_attempt_shape(a)[2] for a in attempts]
    assert [e.http_status for e in ends] == [500, 500, 500]
    assert [e.will_retry for e in ends] == [True, True, False]
    assert len({a[0].attempt_id for a in attempts}) == 3
    assert len(harness.upstream.requests_for("r500")) == 3


async def test_connect_error_is_classified(harness: Harness) -> None:
    harness.start_worker(policy=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.02))
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_id = await harness.submit(f"http://127.0.0.1:{port}/x.sse")
    records = await harness.records(run_id)
    ends = [assert_attempt_shape(a)[2] for a in split(records).values()]
    assert [e.reason for e in ends] == ["transport_connect_error"] * 2
    assert [e.will_retry for e in ends] == [True, False]


async def committed_offsets(bootstrap: str, group_id: str, topic: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group_id)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}


async def test_cancellation_ends_the_attempt_and_another_worker_restreams_the_run(harness: Harness) -> None:
    long_idle = StreamTimeouts(connect_s=2.0, idle_s=60.0, total_s=120.0)
    worker = harness.start_worker(timeouts=long_idle)
    stall_at = WIRE.index(b"\n\n") + 2  # one message, then silence
    url = harness.upstream.url(f"{ROUTE}/tool.sse", stall_after=stall_at, fault_attempts=1, key="rcancel")
    run_id = await harness.submit(url)
    await harness.records(run_id, until=lambda rs: any(isinstance(r, RawSseMessage) for r in rs))
    await harness.stop_worker(worker)  # SIGTERM-like: the stalled attempt is cancelled
    records = await harness.records(run_id, until=lambda rs: any(isinstance(r, TransportEnd) for r in rs))
    _, messages, end = assert_attempt_shape(records)
    assert len(messages) == 1
    assert end.reason == "transport_cancelled" and not end.will_retry and not end.incomplete_message
    # not committed: at least once, so a new worker streams the run again, as a new attempt
    assert committed_offsets_for_run_missing(await committed_offsets(
        harness.bootstrap, harness.group_id, harness.topics.runs))
    harness.start_worker(timeouts=long_idle)
    records = await harness.records(
        run_id, until=lambda rs: any(isinstance(r, TransportEnd) and r.reason == "transport_eof" for r in rs))
    attempts = list(split(records).values())
    assert len(attempts) == 2
    _, second_messages, second_end = assert_attempt_shape(attempts[1])
    assert attempts[1][0].attempt_id != attempts[0][0].attempt_id
    assert attempts[1][0].attempt_number == 1  # a new run of the policy, not a retry of the old one
    assert [(m.event, m.data) for m in second_messages] == expected_messages()


def committed_offsets_for_run_missing(offsets: dict[int, int]) -> bool:
    # the only run on the topic was never completed, so no partition has a committed offset past it
    return all(offset <= 0 for offset in offsets.values())


async def test_concurrent_runs_commit_only_when_done(harness: Harness) -> None:
    harness.start_worker()
    slow = harness.upstream.url(f"{ROUTE}/tool.sse", chunk=64, delay_ms=20)
    run_ids = [await harness.submit(slow) for _ in range(6)]
    for run_id in run_ids:
        records = await harness.records(run_id)
        _, messages, end = assert_attempt_shape(records)
        assert end.reason == "transport_eof"
        assert [(m.event, m.data) for m in messages] == expected_messages()
    # every run was committed: the committed offsets add up to the number of runs
    deadline = time.monotonic() + 10
    while True:
        offsets = await committed_offsets(harness.bootstrap, harness.group_id, harness.topics.runs)
        if sum(offsets.values()) == len(run_ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)  # commits follow acknowledgements asynchronously; polled with a deadline
    assert sum(offsets.values()) == len(run_ids)



async def test_the_commands_submit_ingest_upstream_and_sigterm(harness: Harness, tmp_path: Path) -> None:
    """`callgate upstream`, `callgate submit` and `callgate ingest` as real processes; SIGTERM cancels."""
    import os
    import signal
    import sys

    env = {**os.environ, "CALLGATE_KAFKA_BOOTSTRAP": harness.bootstrap,
           "CALLGATE_TOPIC_NAMESPACE": harness.topics.namespace}

    async def command(*args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "callgate", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)

    upstream = await command("upstream", "--fixtures", str(harness.upstream.fixtures_root), "--port", "0")
    ingest = await command("ingest", "--idle-timeout", "60")
    try:
        assert upstream.stdout is not None
        base_url = (await asyncio.wait_for(upstream.stdout.readline(), 20)).decode().strip()
        assert base_url.startswith("http://127.0.0.1:")
        stall_at = WIRE.index(b"\n\n") + 2  # one message, then silence until SIGTERM
        submit = await command("submit", "--route", ROUTE, "--tools", "read_file,write_file", "--policy", "demo",
                               "--url", f"{base_url}/{ROUTE}/tool.sse?stall_after={stall_at}&key=cli")
        out, _ = await asyncio.wait_for(submit.communicate(), 20)
        assert submit.returncode == 0
        run_id = out.decode().strip()
        assert run_id
        await harness.records(run_id, until=lambda rs: any(isinstance(r, RawSseMessage) for r in rs))
        ingest.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(ingest.wait(), 20) == 0
        start, messages, end = assert_attempt_shape(await harness.records(run_id))
        assert start.tool_set == ["read_file", "write_file"] and start.policy_id == "demo"
        assert len(messages) == 1 and end.reason == "transport_cancelled" and not end.will_retry
        upstream.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(upstream.wait(), 10) == 0
    finally:
        for process in (upstream, ingest):
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_multi_attempt_fixture_is_a_disconnect_then_a_fresh_attempt(harness: Harness) -> None:
    """`attempts=a,b` (how recorded "disconnect, then retry" runs are replayed): two attempts, never mixed."""
    boundary = WIRE.index(b"\n\n", len(WIRE) // 2) + 2
    (harness.upstream.fixtures_root / ROUTE / "cut.attempt1.sse").write_bytes(WIRE[:boundary + 15])
    harness.start_worker()
    url = harness.upstream.url("x", attempts=f"{ROUTE}/cut.attempt1.sse,{ROUTE}/tool.sse", key="rmulti")
    attempts = list(split(await harness.records(await harness.submit(url))).values())
    assert len(attempts) == 2
    _, messages, end = assert_attempt_shape(attempts[0])
    assert [(m.event, m.data) for m in messages] == expected_messages(WIRE[:boundary])
    assert (end.reason, end.incomplete_message, end.will_retry) == ("transport_disconnect", True, True)
    assert_fresh_second_attempt(attempts[0], attempts[1])


async def test_total_deadline_ends_the_attempt_and_is_not_retried(harness: Harness) -> None:
    harness.start_worker(timeouts=StreamTimeouts(connect_s=2.0, idle_s=5.0, total_s=0.6))
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse", chunk=16, delay_ms=10, key="rtotal"))
    records = await harness.records(run_id)
    assert len(split(records)) == 1  # the budget is spent: a retry would only spend another
    _, messages, end = assert_attempt_shape(records)
    assert end.reason == "transport_total_timeout" and not end.will_retry
    assert 0 < end.bytes_received < len(WIRE)
    got = [(m.event, m.data) for m in messages]
    # a prefix: the deadline may fall between publishing two messages of the last chunk
    assert got and got == expected_messages(WIRE[:end.bytes_received])[:len(got)]


async def test_a_decoder_limit_ends_the_attempt_classified(harness: Harness) -> None:
    longest = max(len(line) for line in WIRE.split(b"\n"))
    harness.start_worker(max_line_bytes=longest - 1)
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse", key="rlimit"))
    records = await harness.records(run_id)
    assert len(split(records)) == 1  # the same bytes would break the same limit again
    _, messages, end = assert_attempt_shape(records)
    assert end.reason == "sse_line_too_long" and not end.will_retry
    first_long = next(i for i, line in enumerate(WIRE.split(b"\n")) if len(line) == longest)
    before = b"\n".join(WIRE.split(b"\n")[:first_long])
    assert [(m.event, m.data) for m in messages] == expected_messages(before[:before.rfind(b"\n\n") + 2])


async def test_a_message_too_big_for_one_record_ends_the_attempt_instead_of_failing_the_worker(
    harness: Harness,
) -> None:
    big = b"event: a\ndata: small\n\nevent: b\ndata: " + b"x" * 1_200_000 + b"\n\nevent: c\ndata: after\n\n"
    (harness.upstream.fixtures_root / ROUTE / "big.sse").write_bytes(big)
    worker = harness.start_worker(max_line_bytes=4 << 20, max_message_bytes=4 << 20)  # past what Kafka takes
    run_id = await harness.submit(harness.upstream.url(f"{ROUTE}/big.sse", key="rbig"))
    records = await harness.records(run_id)
    _, messages, end = assert_attempt_shape(records)
    assert [m.data for m in messages] == ["small"]
    assert end.reason == "sse_message_too_large" and not end.will_retry
    # and the worker carries on with the next run
    second = await harness.submit(harness.upstream.url(f"{ROUTE}/tool.sse"))
    assert assert_attempt_shape(await harness.records(second))[2].reason == "transport_eof"
    assert worker.runs_finished >= 1
