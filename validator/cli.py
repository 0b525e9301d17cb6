"""`callgate validator`, `callgate approve CALL_ID`, `callgate deny CALL_ID --why TEXT`.

approve / deny look the call up on the pending topic (restricted: operators
only), then write an Approval keyed by the call's *run id*, so it lands on the
partition of the validator that owns the pending call, carrying the pending
call's args_hmac: the answer binds to exactly the arguments shown.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
import time

from callgate.avro import decode, encode
from callgate.errors import RecordError
from callgate.kafka import make_producer, read_topic
from callgate.records import Approval, PendingCall
from callgate.settings import Settings

from validator.approvals import APPROVE, DENY


async def find_pending(bootstrap: str, topic: str, call_id: str) -> PendingCall | None:
    for record in await read_topic(bootstrap, topic):
        try:
            value = decode(record.value, topic=record.topic, partition=record.partition, offset=record.offset)
        except RecordError:
            continue
        if isinstance(value, PendingCall) and value.call_id == call_id:
            return value
    return None


async def answer(
    settings: Settings, call_id: str, decision: str, *, decided_by: str, why: str | None = None,
    show_args: bool = False,
) -> int:
    topics = settings.topics
    pending = await find_pending(settings.kafka_bootstrap, topics.calls_pending, call_id)
    if pending is None:
        print(f"no pending call {call_id} on {topics.calls_pending}", file=sys.stderr)
        return 2
    print(f"call {pending.call_id} run {pending.run_id} tool {pending.tool_name} rule {pending.why} "
          f"policy {pending.policy_id}@{pending.policy_version} args {len(pending.arguments)} bytes")
    if show_args:
        print(pending.arguments.decode("utf-8"))
    approval = Approval(
        call_id=pending.call_id, decision=decision, decided_by=decided_by,
        decided_at=int(time.time() * 1000), why=why, run_id=pending.run_id, args_hmac=pending.args_hmac,
    )
    producer = await make_producer(settings.kafka_bootstrap)
    try:
        await producer.send_and_wait(topics.approvals, encode(approval), key=pending.run_id.encode())
    finally:
        await producer.stop()
    print(f"{decision} written to {topics.approvals}")
    return 0


def _run_answer(args: argparse.Namespace, decision: str) -> int:
    settings = Settings.from_env()
    if args.namespace:
        settings = settings.model_copy(update={"topic_namespace": args.namespace})
    return asyncio.run(
        answer(settings, args.call_id, decision, decided_by=args.by or getpass.getuser(),
               why=getattr(args, "why", None), show_args=getattr(args, "show_args", False))
    )


def _run_worker(args: argparse.Namespace) -> int:
    from validator.worker import main

    return main()


def register(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("validator", help="run the validator worker until SIGTERM")
    worker.set_defaults(func=_run_worker)

    approve = subparsers.add_parser("approve", help="approve a pending call")
    approve.add_argument("call_id")
    approve.add_argument("--by", help="approver name (default: the login name)")
    approve.add_argument("--show-args", action="store_true", help="print the canonical arguments first")
    approve.add_argument("--namespace", help="topic namespace (default: CALLGATE_TOPIC_NAMESPACE)")
    approve.set_defaults(func=lambda a: _run_answer(a, APPROVE))

    deny = subparsers.add_parser("deny", help="deny a pending call")
    deny.add_argument("call_id")
    deny.add_argument("--why", required=True, help="reason, recorded on the approvals topic")
    deny.add_argument("--by", help="approver name (default: the login name)")
    deny.add_argument("--namespace", help="topic namespace (default: CALLGATE_TOPIC_NAMESPACE)")
    deny.set_defaults(func=lambda a: _run_answer(a, DENY))
