"""Pipeline throughput, decision latency, the passthrough ceiling and memory per open item (on demand).

    .venv/bin/python bench/pipeline.py [--runs 1500] [--latency-runs 300] [--profile]

Everything goes through a real broker of its own (a LocalBroker on a free
port in a temporary directory), with the normalizer and validator as real
worker processes (`python -m callgate normalizer|validator`), as in the demo.

Input: sse.raw is *pre-loaded* with the records ingest would publish for N runs
(AttemptStarted, one RawSseMessage per SSE event, TransportEnd), made from the
shipped single-attempt fixtures by `normalizer.check.attempt_records` (the
ingest decoder over the fixture bytes). The ingest HTTP client itself is not
in the measured path: its decoder has its own benchmark (bench/sse_decoder.py).

(a) throughput: SSE events per second through the normalizer, and through
    normalizer + validator together, from the first output record's
    timestamp to the last one (so worker start-up is not counted);
(b) decision latency at a fixed offered load (half the ceiling, in events/s,
    spread over concurrent runs): from just before the terminal event's
    record is sent to sse.raw, to the ApprovedCall being returned by a
    read_committed consumer on calls.approved (what an executor sees);
(c) the ceiling: a bare aiokafka consume-and-produce passthrough over the same
    pre-loaded sse.raw in the same run (read_committed consumer group,
    idempotent acks=all producer, offsets committed per batch), and the same
    with one transaction per batch, which is the stages' protocol;
(d) memory per open item: tracemalloc over the normalizer core (`Normalizer`)
    with many runs each holding one open function-call item.

--profile runs the normalizer worker under cProfile during (a) (its figures
are then the profiled ones) and prints its hottest functions; the core is
always profiled in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

# keep bench/ itself from shadowing packages
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from aiokafka import TopicPartition  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # noqa: E402

from callgate import avro  # noqa: E402
from callgate.broker import LocalBroker, free_port  # noqa: E402
from callgate.kafka import STAGE_RETRY_BACKOFF_MS, create_topics, make_consumer, make_producer  # noqa: E402
from callgate.pipeline import FIXTURES_ROOT, load_fixture_specs, write_policies  # noqa: E402
from callgate.records import ApprovedCall, RawSseMessage, TerminalItem  # noqa: E402
from callgate.supervise import WorkerProcess  # noqa: E402
from callgate.topics import TopicNames  # noqa: E402
from normalizer.accumulator import Normalizer  # noqa: E402
from normalizer.check import attempt_records  # noqa: E402

PARTITIONS = 3


@dataclass(slots=True)
class Run:
    run_id: str
    records: list  # AttemptStarted, RawSseMessage..., TransportEnd
    terminals: dict[int, str]  # index of the record whose arrival closes an item -> item id
    approvable: bool


def _templates() -> list:
    specs = [s for s in load_fixture_specs(FIXTURES_ROOT) if len(s.attempts) == 1 and s.expected]
    if not specs:
        raise SystemExit("no single-attempt fixtures with expectations under fixtures/")
    return specs


def make_runs(n: int, *, approvable_only: bool = False) -> list[Run]:
    """n runs cycling over the shipped fixtures; each record list is what ingest would publish."""
    templates = _templates()
    if approvable_only:
        templates = [s for s in templates if any(e.state == "POLICY_APPROVED" for e in s.expected)]
    wires = {s.label: (FIXTURES_ROOT / s.attempts[0]).read_bytes() for s in templates}
    runs = []
    now = int(time.time() * 1000)
    for index in range(n):
        spec = templates[index % len(templates)]
        run_id = f"bench-{uuid.uuid4().hex[:16]}"
        records = attempt_records(
            wires[spec.label], run_id=run_id, attempt_id=f"att-{uuid.uuid4().hex[:16]}", attempt_number=1,
            route=spec.route, tool_set=list(spec.tool_set), policy_id=spec.policy_id, start_ms=now,
        )
        # which record closes which item: replay the run through the pure core once
        core = Normalizer()
        terminals = {}
        for at, record in enumerate(records):
            for out in core.feed(record):
                if isinstance(out, TerminalItem):
                    terminals[at] = out.item_id
        approvable = any(e.state == "POLICY_APPROVED" for e in spec.expected)
        runs.append(Run(run_id, records, terminals, approvable))
    return runs


def sse_events(runs: list[Run]) -> int:
    return sum(isinstance(r, RawSseMessage) for run in runs for r in run.records)


async def preload(bootstrap: str, topic: str, runs: list[Run]) -> float:
    """Publish every run's records as ingest does (idempotent, acks=all, keyed by run id); returns seconds."""
    producer = await make_producer(bootstrap, linger_ms=5)
    started = time.perf_counter()
    try:
        futures = []
        for run in runs:
            key = run.run_id.encode()
            for record in run.records:
                futures.append(await producer.send(topic, avro.encode(record), key=key))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return time.perf_counter() - started


async def end_offsets(bootstrap: str, topic: str) -> dict[TopicPartition, int]:
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        return await consumer.end_offsets(tps)
    finally:
        await consumer.stop()


async def committed_reached(bootstrap: str, group: str, targets: dict[TopicPartition, int]) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    # the last stable offset counts transaction markers; a committed offset past the last record is enough
    return all(tp in offsets and offsets[tp].offset >= end - 1 for tp, end in targets.items() if end > 0)


async def output_span(bootstrap: str, topic: str, *, stage: str | None = None) -> tuple[int, int, int]:
    """(first timestamp, last timestamp, count) of a topic's committed records, optionally one stage's audit."""
    consumer = await make_consumer(bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        first, last, count = None, None, 0
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for records in batch.values():
                for r in records:
                    if stage is not None and avro.decode(r.value).stage != stage:
                        continue
                    count += 1
                    first = r.timestamp if first is None else min(first, r.timestamp)
                    last = r.timestamp if last is None else max(last, r.timestamp)
        return first or 0, last or 0, count
    finally:
        await consumer.stop()


async def wait_until(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        await asyncio.sleep(0.2)  # polling a condition under a deadline


# ------------------------------------------------------------------ (c) ceiling


async def passthrough(bootstrap: str, source: str, sink: str, total: int, *, transactional: bool,
                      **producer_options) -> float:
    """Consume `source` from the start and copy every record to `sink`; events/s over first..last send."""
    group = f"bench-pass-{uuid.uuid4().hex[:8]}"
    consumer = await make_consumer(bootstrap, source, group_id=group, max_poll_records=500)
    producer = await make_producer(
        bootstrap, transactional_id=f"{group}-tx" if transactional else None, linger_ms=0, **producer_options
    )
    copied, first = 0, None
    try:
        while copied < total:
            batch = await consumer.getmany(timeout_ms=500, max_records=500)
            if not batch:
                continue
            first = first or time.perf_counter()
            offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
            if transactional:
                async with producer.transaction():
                    await producer.send_offsets_to_transaction(offsets, group)
                    for records in batch.values():
                        for r in records:
                            await producer.send(sink, r.value, key=r.key)
            else:
                futures = [await producer.send(sink, r.value, key=r.key) for records in batch.values() for r in records]
                await asyncio.gather(*futures)
                await consumer.commit(offsets)
            copied += sum(len(records) for records in batch.values())
        return time.perf_counter() - first
    finally:
        await producer.stop()
        await consumer.stop()


# ------------------------------------------------------------------ (b) latency


Seen = dict[tuple[str, str], tuple[float, int, int]]  # (run, item) -> (perf_counter, partition, offset)
OnSent = Callable[[Run, int, float, "asyncio.Future"], None]


async def offer_and_watch(
    bootstrap: str, topics: TopicNames, runs: list[Run], rate: float, concurrency: int, on_sent: OnSent
) -> Seen:
    """Offer `rate` events/s over `concurrency` interleaved runs; when each approved call becomes visible.

    `on_sent(run, index, t_send, future)` is told of every record sent. The
    approved records are watched by a read_committed consumer, as an executor
    would see them.
    """
    seen: Seen = {}
    expected = {(run.run_id, item) for run in runs if run.approvable for item in run.terminals.values()}
    watcher = await make_consumer(bootstrap, group_id=None, fetch_max_wait_ms=20)
    tps = [TopicPartition(topics.calls_approved, p) for p in range(PARTITIONS)]
    watcher.assign(tps)
    await watcher.seek_to_end(*tps)
    for tp in tps:
        await watcher.position(tp)
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            batch = await watcher.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batch.values():
                for r in records:
                    call = avro.decode(r.value)
                    if isinstance(call, ApprovedCall):
                        seen.setdefault((call.run_id, call.item_id), (now, r.partition, r.offset))

    watching = asyncio.create_task(watch())
    producer = await make_producer(bootstrap, linger_ms=0)
    try:
        # the offered load: one record every 1/rate s, round robin over `concurrency` open runs
        queue = list(runs)
        active: list[tuple[Run, int]] = []
        started = time.perf_counter()
        sent = 0
        while queue or active:
            while len(active) < concurrency and queue:
                active.append((queue.pop(0), 0))
            due = int((time.perf_counter() - started) * rate) + 1
            while sent < due and active:
                run, at = active.pop(0)
                t_send = time.perf_counter()
                future = await producer.send(topics.sse_raw, avro.encode(run.records[at]), key=run.run_id.encode())
                on_sent(run, at, t_send, future)
                sent += 1
                if at + 1 < len(run.records):
                    active.append((run, at + 1))
            await asyncio.sleep(0.002)  # pacing the offered load, not synchronisation
        print(f"offered {sent / (time.perf_counter() - started):,.0f} ev/s", file=sys.stderr)
        await producer.flush()
        deadline = time.monotonic() + 60
        while not expected <= set(seen) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the approved records arriving, under a deadline
    finally:
        done.set()
        await watching
        await producer.stop()
        await watcher.stop()
    missing = expected - set(seen)
    if missing:
        print(f"warning: {len(missing)} approved calls not seen within the deadline", file=sys.stderr)
    return {k: v for k, v in seen.items() if k in expected}


async def latency(bootstrap: str, topics: TopicNames, runs: list[Run], rate: float, concurrency: int) -> list[float]:
    """Ms from a terminal record's send to its approved record being visible."""
    sent_at: dict[tuple[str, str], float] = {}

    def on_sent(run: Run, at: int, t_send: float, _future) -> None:
        if at in run.terminals:
            sent_at[(run.run_id, run.terminals[at])] = t_send

    seen = await offer_and_watch(bootstrap, topics, runs, rate, concurrency, on_sent)
    return sorted((seen[k][0] - sent_at[k]) * 1000 for k in seen if k in sent_at)


# ------------------------------------------------------------------ (d) memory


def memory_per_open_item(n: int) -> tuple[float, float]:
    """(bytes per open item, of which argument bytes) with n runs each holding one open call.

    Each run is a fixture's records up to (not including) the one that closes
    its item, decoded afresh as the worker would, so what tracemalloc still
    counts after feeding is exactly what the core keeps.
    """
    template = [r for r in make_runs(60, approvable_only=True) if len(r.terminals) == 1]
    prefixes = [[avro.encode(r) for r in run.records[: min(run.terminals)]] for run in template]
    core = Normalizer()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for index in range(n):
        run_id = f"mem-{index:07d}"
        for value in prefixes[index % len(prefixes)]:
            core.feed(replace(avro.decode(value), run_id=run_id))
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in snapshot.compare_to(base, "filename"))
    open_items = sum(run.open_items() for run in core.runs.values())
    args_bytes = sum(len(i.buffer) for run in core.runs.values() if run.attempt is not None
                     for i in run.attempt.open_calls())
    return used / max(open_items, 1), args_bytes / max(open_items, 1)


def profile_core(runs: list[Run]) -> tuple[float, str]:
    """Events/s of the pure normalizer core over decoded records, and its cProfile top functions."""
    encoded = [avro.encode(r) for run in runs for r in run.records]
    core = Normalizer()
    started = time.perf_counter()
    for value in encoded:
        core.feed(avro.decode(value))
    elapsed = time.perf_counter() - started
    profiler = cProfile.Profile()
    core = Normalizer()
    profiler.enable()
    for value in encoded:
        core.feed(avro.decode(value))
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(14)
    return sse_events(runs) / elapsed, out.getvalue()


# ------------------------------------------------------------------ main


async def bench(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="callgate-bench-"))
    broker = LocalBroker(state_dir=work / "broker", port=free_port())
    await asyncio.to_thread(broker.start)
    bootstrap = broker.address
    topics = TopicNames(f"bench{uuid.uuid4().hex[:8]}")
    workers: list[WorkerProcess] = []
    rows: list[tuple[str, str]] = []
    try:
        await create_topics(bootstrap, topics, PARTITIONS)
        sink = f"{topics.namespace}.bench.passthrough"
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(sink, PARTITIONS, 1)])
        await admin.close()

        runs = make_runs(args.runs)
        events = sse_events(runs)
        records = sum(len(r.records) for r in runs)
        load_s = await preload(bootstrap, topics.sse_raw, runs)
        print(f"pre-loaded {len(runs)} runs: {events} SSE events, {records} records in {load_s:.1f}s", file=sys.stderr)

        # a fresh JVM runs slow for its first seconds: warm the broker up with one discarded pass
        await passthrough(bootstrap, topics.sse_raw, sink, records, transactional=False)
        await passthrough(bootstrap, topics.sse_raw, sink, records, transactional=True,
                          retry_backoff_ms=STAGE_RETRY_BACKOFF_MS)
        bare_s = min([await passthrough(bootstrap, topics.sse_raw, sink, records, transactional=False)
                      for _ in range(2)])
        # the stages' producer settings, so the comparison is with the same protocol
        txn_s = min([await passthrough(bootstrap, topics.sse_raw, sink, records, transactional=True,
                                       retry_backoff_ms=STAGE_RETRY_BACKOFF_MS) for _ in range(2)])
        ceiling = events / bare_s
        print(f"passthrough: bare {ceiling:,.0f} ev/s, transactional {events / txn_s:,.0f} ev/s", file=sys.stderr)

        log_dir = work / "logs"
        env = {
            "CALLGATE_KAFKA_BOOTSTRAP": bootstrap, "CALLGATE_TOPIC_NAMESPACE": topics.namespace,
            "CALLGATE_PARTITIONS": str(PARTITIONS), "CALLGATE_SIGNING_KEYS": f"bench:{'ab' * 32}",
            "CALLGATE_SIGNING_KEY_ID": "bench", "CALLGATE_POLICIES_DIR": str(work / "policies"),
        }
        write_policies(work / "policies", work / "workspaces")
        profile_path = work / "normalizer.prof"
        normalizer = WorkerProcess("normalizer", env, log_dir, name="normalizer",
                                   interpreter_args=("-m", "cProfile", "-o", str(profile_path)) if args.profile else ())
        validator = WorkerProcess("validator", env, log_dir, name="validator")
        workers += [normalizer, validator]
        raw_end = await end_offsets(bootstrap, topics.sse_raw)
        normalizer.start()
        validator.start()

        async def normalized() -> bool:
            if not normalizer.running:
                raise RuntimeError(f"normalizer exited:\n{normalizer.logs()[-3000:]}")
            return await committed_reached(bootstrap, f"{topics.namespace}-normalizer", raw_end)

        await wait_until(normalized, timeout_s=600, what="the normalizer did not drain sse.raw")
        items_end = await end_offsets(bootstrap, topics.items)

        async def validated() -> bool:
            if not validator.running:
                raise RuntimeError(f"validator exited:\n{validator.logs()[-3000:]}")
            return await committed_reached(bootstrap, f"{topics.namespace}-validator", items_end)

        await wait_until(validated, timeout_s=600, what="the validator did not drain items")
        n_first, n_last, _ = await output_span(bootstrap, topics.audit, stage="normalizer")
        i_first, i_last, n_items = await output_span(bootstrap, topics.items)
        v_first, v_last, _ = await output_span(bootstrap, topics.audit, stage="validator")
        normalizer_eps = events / max((max(n_last, i_last) - min(n_first, i_first)) / 1000, 1e-3)
        pipeline_eps = events / max((v_last - min(n_first, i_first)) / 1000, 1e-3)

        if args.profile:
            await asyncio.to_thread(normalizer.stop)
            normalizer.interpreter_args = ()
            normalizer.start()
        def percentiles(lat: list[float]) -> tuple[float, float]:
            if not lat:
                return float("nan"), float("nan")
            return statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))]

        # at half the ceiling (the target's load), and at half of what the pipeline itself sustains
        rate = ceiling / 2
        p50, p99 = percentiles(await latency(bootstrap, topics, make_runs(args.latency_runs, approvable_only=True),
                                             rate, args.concurrency))
        own_rate = pipeline_eps / 2
        own_p50, own_p99 = percentiles(await latency(
            bootstrap, topics, make_runs(args.latency_runs, approvable_only=True), own_rate, args.concurrency))

        per_item, args_per_item = memory_per_open_item(args.open_items)
        core_eps, core_profile = profile_core(make_runs(min(args.runs, 600)))

        rows = [
            ("passthrough ceiling, bare (consume + produce + commit)", f"{ceiling:,.0f} ev/s"),
            ("passthrough, one transaction per batch", f"{events / txn_s:,.0f} ev/s"),
            ("normalizer worker (items + audit out, transactional)", f"{normalizer_eps:,.0f} ev/s"),
            ("normalizer / bare ceiling", f"{normalizer_eps / ceiling:.0%} (target >= 70%)"),
            ("normalizer / transactional passthrough", f"{normalizer_eps * txn_s / events:.0%}"),
            ("normalizer + validator end to end", f"{pipeline_eps:,.0f} ev/s ({pipeline_eps / ceiling:.0%} of ceiling)"),
            ("normalizer core alone, in-process (decode + feed)", f"{core_eps:,.0f} ev/s"),
            (f"decision latency p50 at {rate:,.0f} ev/s offered", f"{p50:.1f} ms"),
            (f"decision latency p99 at {rate:,.0f} ev/s offered", f"{p99:.1f} ms (target < 100 ms)"),
            (f"decision latency p50 at {own_rate:,.0f} ev/s (half the pipeline's own rate)", f"{own_p50:.1f} ms"),
            (f"decision latency p99 at {own_rate:,.0f} ev/s (half the pipeline's own rate)", f"{own_p99:.1f} ms"),
            ("memory per open item (normalizer core)", f"{per_item:,.0f} B ({args_per_item:,.0f} B of it arguments)"),
        ]
        print(f"\n{len(runs)} runs, {events} SSE events ({records} records), {n_items} terminal items, "
              f"{PARTITIONS} partitions, one worker per stage\n")
        print("| measure | value |\n| --- | --- |")
        for name, value in rows:
            print(f"| {name} | {value} |")
        print("\nnormalizer core profile (cumulative):\n" + core_profile)
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(broker.stop)
    if args.profile and profile_path.exists():
        out = io.StringIO()
        pstats.Stats(str(profile_path), stream=out).sort_stats("tottime").print_stats(25)
        print("normalizer worker profile (tottime, during (a)):\n" + out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1500, help="runs pre-loaded for (a) and (c)")
    parser.add_argument("--latency-runs", type=int, default=300, help="runs offered for (b)")
    parser.add_argument("--concurrency", type=int, default=20, help="runs streaming at once in (b)")
    parser.add_argument("--open-items", type=int, default=5000, help="open items for (d)")
    parser.add_argument("--profile", action="store_true", help="profile the normalizer worker during (a)")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
