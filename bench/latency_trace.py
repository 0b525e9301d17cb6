"""Where decision latency goes: one traced pass through the real normalizer and validator (on demand).

    .venv/bin/python bench/latency_trace.py [--rate 12000] [--runs 1500] [--concurrency 20]

Same set-up as bench/pipeline.py's (b): a broker of its own, the two workers
as real processes, approvable runs offered at a fixed rate. The workers run
with bench/trace_hook on PYTHONPATH, which timestamps every batch, every
transaction step and every Kafka request (see its docstring). After one
untimed warm-up pass, each approved call of the traced pass is followed
through both stages by offsets (sse.raw offset -> the normalizer transaction
that consumed it; calls.approved offset -> the validator transaction that
wrote it), and its latency is split into segments:

    send->N fetch       terminal record sent -> the normalizer's getmany returned it
    N fetch->txn start  processing, and earlier partitions of the same batch
    N offsets           begin + AddOffsetsToTxn + TxnOffsetCommit
    N sends->commit     AddPartitionsToTxn + Produce + EndTxn
    N commit->V fetch   markers written, LSO moved, validator fetched (or was busy)
    V ...               the same in the validator
    V commit->seen      the bench's read_committed watcher saw the ApprovedCall

Also per stage: share of the busy time in commits, in getmany, and the rest
(processing), per-request round trips and error codes, and CPU per process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE))
import pipeline as bp  # noqa: E402  bench/pipeline.py (which takes bench/ off sys.path again)


from callgate.broker import LocalBroker, free_port  # noqa: E402
from callgate.kafka import create_topics  # noqa: E402
from callgate.pipeline import write_policies  # noqa: E402
from callgate.supervise import WorkerProcess  # noqa: E402
from callgate.topics import TopicNames  # noqa: E402


async def offered(bootstrap: str, topics: TopicNames, runs: list, rate: float, concurrency: int) -> list[dict]:
    """bench/pipeline.py's latency pass, keeping each terminal record's offset and each approval's offset."""
    sent: dict[tuple[str, str], tuple[float, object]] = {}

    def on_sent(run, at: int, t_send: float, future) -> None:
        if at in run.terminals:
            sent[(run.run_id, run.terminals[at])] = (t_send, future)

    seen = await bp.offer_and_watch(bootstrap, topics, runs, rate, concurrency, on_sent)
    rows = []
    for key in set(seen) & set(sent):
        at_send, future = sent[key]
        meta = future.result()
        rows.append({"t_send": at_send, "p": meta.partition, "o": meta.offset,
                     "t_seen": seen[key][0], "out_p": seen[key][1], "out_o": seen[key][2]})
    return rows


def _q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def analyse(rows: list[dict], trace_dir: Path, mark: float) -> None:
    lines_by_pid = {f: [json.loads(line) for line in f.open()] for f in trace_dir.glob("*.jsonl")}
    txns = [d for lines in lines_by_pid.values() for d in lines if d["k"] == "txn"]
    stage = {"normalizer": [t for t in txns if t["g"].endswith("normalizer")],
             "validator": [t for t in txns if t["g"].endswith("validator")]}

    def consumed(ts: list[dict], suffix: str, p: int, o: int) -> dict | None:
        for t in ts:
            for key, (start, end) in t["in"].items():
                topic, part = key.rsplit(":", 1)
                if topic.endswith(suffix) and int(part) == p and start <= o < end:
                    return t
        return None

    def wrote(ts: list[dict], suffix: str, p: int, o: int) -> dict | None:
        for t in ts:
            for topic, part, offset, _ in t["out"]:
                if topic.endswith(suffix) and part == p and offset == o:
                    return t
        return None

    segments: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        n = consumed(stage["normalizer"], ".sse.raw", r["p"], r["o"])
        v = wrote(stage["validator"], ".calls.approved", r["out_p"], r["out_o"])
        if n is None or v is None:
            continue
        for name, ms in (
            ("send->N fetch", n["t_fetch"] - r["t_send"]),
            ("N fetch->txn start", n["t_start"] - n["t_fetch"]),
            ("N offsets", n["t_offsets"] - n["t_begin"]),
            ("N sends->commit", n["t_commit"] - n["t_sends"]),
            ("N commit->V fetch", v["t_fetch"] - n["t_commit"]),
            ("V fetch->txn start", v["t_start"] - v["t_fetch"]),
            ("V offsets", v["t_offsets"] - v["t_begin"]),
            ("V sends->commit", v["t_commit"] - v["t_sends"]),
            ("V commit->seen", r["t_seen"] - v["t_commit"]),
            ("total", r["t_seen"] - r["t_send"]),
        ):
            segments[name].append(ms * 1000)
    print(f"\n{len(segments['total'])} of {len(rows)} approved calls traced through both stages\n")
    print("| segment | p50 ms | p90 ms | p99 ms |\n| --- | --- | --- | --- |")
    for name, values in segments.items():
        print(f"| {name} | {_q(values, .5):.1f} | {_q(values, .9):.1f} | {_q(values, .99):.1f} |")
    for name, ts in stage.items():
        ts = [t for t in ts if t["t_start"] >= mark]
        if not ts:
            continue
        clients = {t["c"] for t in ts}
        lines = next(lines for lines in lines_by_pid.values() if any(d.get("c") in clients for d in lines))
        batches = [d for d in lines if d["k"] == "getmany" and d["t1"] >= mark]
        first, last = min(t["t_fetch"] for t in ts), max(t["t_commit"] for t in ts)
        span = last - first
        # concurrent commits overlap: count the union of their intervals, not the sum
        busy_commit, cursor = 0.0, first
        for start, end in sorted((t["t_start"], t["t_commit"]) for t in ts):
            if end > cursor:
                busy_commit += end - max(start, cursor)
                cursor = end
        waiting = sum(d["t1"] - d["t0"] for d in batches if first <= d["t1"] <= last)
        records = sum(end - start for t in ts for start, end in t["in"].values())
        print(f"\n{name}: {len(batches)} batches, {len(ts)} transactions, {records} records in "
              f"{span * 1000:.0f} ms busy: in commits {busy_commit / span:.0%}, in getmany {waiting / span:.0%}, "
              f"processing and the rest {(span - busy_commit - waiting) / span:.0%}")
        by_api, errors = collections.defaultdict(list), collections.Counter()
        for d in lines:
            if d["k"] == "req" and d["c"] in clients and d["t0"] >= mark:
                by_api[d["api"].removesuffix("Request")].append((d["t1"] - d["t0"]) * 1000)
                if d.get("err"):
                    errors[(d["api"], d["err"])] += 1
        for api, values in sorted(by_api.items()):
            print(f"  {api}: n={len(values)} p50 {_q(values, .5):.1f} ms, p90 {_q(values, .9):.1f} ms, "
                  f"max {max(values):.1f} ms")
        print(f"  error codes: {dict(errors) or 'none'}; commit p50 "
              f"{statistics.median((t['t_commit'] - t['t_start']) * 1000 for t in ts):.1f} ms")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="callgate-trace-"))
    trace_dir = work / "trace"
    trace_dir.mkdir()
    broker = LocalBroker(state_dir=work / "broker", port=free_port())
    await asyncio.to_thread(broker.start)
    topics = TopicNames(f"trace{uuid.uuid4().hex[:8]}")
    workers: list[WorkerProcess] = []
    try:
        await create_topics(broker.address, topics, bp.PARTITIONS)
        env = {
            "CALLGATE_KAFKA_BOOTSTRAP": broker.address, "CALLGATE_TOPIC_NAMESPACE": topics.namespace,
            "CALLGATE_PARTITIONS": str(bp.PARTITIONS), "CALLGATE_SIGNING_KEYS": f"bench:{'ab' * 32}",
            "CALLGATE_SIGNING_KEY_ID": "bench", "CALLGATE_POLICIES_DIR": str(work / "policies"),
            "PYTHONPATH": os.pathsep.join([str(HERE / "trace_hook"), os.environ.get("PYTHONPATH", "")]),
            "CALLGATE_TRACE_DIR": str(trace_dir),
        }
        write_policies(work / "policies", work / "workspaces")
        for name in ("normalizer", "validator"):
            worker = WorkerProcess(name, env, work / "logs", name=name)
            worker.start()
            workers.append(worker)
        await offered(broker.address, topics, bp.make_runs(args.runs, approvable_only=True), args.rate,
                      args.concurrency)  # warm-up: worker start-up and a cold JVM
        pids = {w.name: w.process.pid for w in workers} | {"broker": broker.running_pid(), "bench": os.getpid()}
        cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
        mark = time.perf_counter()
        rows = await offered(broker.address, topics, bp.make_runs(args.runs, approvable_only=True), args.rate,
                             args.concurrency)
        wall = time.perf_counter() - mark
        cpu = ", ".join(f"{name} {(_cpu_s(pid) - cpu_before[name]) / wall:.0%}" for name, pid in pids.items())
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)  # a clean exit flushes the trace files
        await asyncio.to_thread(broker.stop)
    total = sorted((r["t_seen"] - r["t_send"]) * 1000 for r in rows)
    print(f"traced pass: {len(total)} approved calls, p50 {_q(total, .5):.1f} ms, p99 {_q(total, .99):.1f} ms; "
          f"CPU of one core over its {wall:.2f} s: {cpu}; load average {os.getloadavg()[0]:.2f}")
    analyse(rows, trace_dir, mark)
    print(f"\ntrace files: {trace_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=12000, help="offered SSE events per second")
    parser.add_argument("--runs", type=int, default=1500, help="approvable runs per pass")
    parser.add_argument("--concurrency", type=int, default=20, help="runs streaming at once")
    asyncio.run(main(parser.parse_args()))
