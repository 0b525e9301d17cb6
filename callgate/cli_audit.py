"""`callgate audit tail` and `callgate trace RUN_ID`: read the sanitized audit topic.

Both read with read_committed and no consumer group, so they never move a
worker's offsets. A record that does not decode is reported with its topic
and offset and skipped: an audit reader must not crash-loop on one bad record.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from aiokafka import ConsumerRecord

from callgate import avro
from callgate.errors import RecordError
from callgate.kafka import TopicMissing, iter_topic, read_topic
from callgate.records import AuditRecord
from callgate.settings import Settings
from callgate.trace import build_timeline, render_html, render_text


def _decoded(message: ConsumerRecord, run_id: str | None) -> AuditRecord | None:
    try:
        record = avro.decode(message.value, topic=message.topic, partition=message.partition, offset=message.offset)
    except RecordError as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        return None
    if not isinstance(record, AuditRecord) or (run_id is not None and record.run_id != run_id):
        return None
    return record


async def read_audit(
    bootstrap: str, topic: str, *, follow: bool, run_id: str | None = None
) -> AsyncIterator[AuditRecord]:
    if follow:
        async for message in iter_topic(bootstrap, topic):
            if (record := _decoded(message, run_id)) is not None:
                yield record
        return
    for message in await read_topic(bootstrap, topic):
        if (record := _decoded(message, run_id)) is not None:
            yield record


def _as_json(record: AuditRecord) -> str:
    return json.dumps(dataclasses.asdict(record), sort_keys=True)


async def _tail(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    bootstrap = args.bootstrap or settings.kafka_bootstrap
    topic = settings.topics.audit if args.namespace is None else f"{args.namespace}.audit"
    async for record in read_audit(bootstrap, topic, follow=not args.no_follow, run_id=args.run):
        print(_as_json(record), flush=True)
    return 0


async def _trace(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    bootstrap = args.bootstrap or settings.kafka_bootstrap
    topic = settings.topics.audit if args.namespace is None else f"{args.namespace}.audit"
    records = [r async for r in read_audit(bootstrap, topic, follow=False, run_id=args.run_id)]
    timeline = build_timeline(args.run_id, records)
    if not records:
        print(f"no audit records for run {args.run_id}", file=sys.stderr)
        return 1
    sys.stdout.write(render_text(timeline))
    if args.html:
        Path(args.html).write_text(render_html(timeline), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _run(coro_fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(coro_fn(args))
        except TopicMissing as exc:
            print(f"topic {exc} does not exist: run `callgate topics create` first", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap", help="Kafka bootstrap address (default: CALLGATE_KAFKA_BOOTSTRAP)")
    common.add_argument("--namespace", help="topic namespace (default: CALLGATE_TOPIC_NAMESPACE)")

    audit = subparsers.add_parser("audit", help="read the sanitized audit topic")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    tail = audit_sub.add_parser("tail", parents=[common], help="print audit records as JSON lines")
    tail.add_argument("--run", help="only this run id")
    tail.add_argument("--no-follow", action="store_true", help="stop at the current end of the topic")
    tail.set_defaults(func=_run(_tail))

    trace = subparsers.add_parser("trace", parents=[common], help="one run's timeline from the audit topic")
    trace.add_argument("run_id")
    trace.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page")
    trace.set_defaults(func=_run(_trace))
