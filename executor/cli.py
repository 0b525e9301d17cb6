"""`callgate executor` (run the worker until SIGTERM) and `callgate ledger show CALL_ID`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
import signal
from pathlib import Path

from callgate import avro
from callgate.errors import ExecutionError, Reason
from callgate.records import ApprovedCall, LedgerEntry
from callgate.settings import Settings
from executor.tools import Limits, ToolContext


def digest_key_from(signing_key: bytes) -> bytes:
    """The ledger's intent-digest key, derived so no extra secret needs provisioning."""
    return hmac.new(signing_key, b"callgate.executor.intent-digest.v1", hashlib.sha256).digest()


def policy_context(policies_dir: Path, limits: Limits):
    """Tool contexts from the validator's policy files: the http allowlist, the workspace cross-check."""
    try:
        from validator.policy import PolicySet
    except ImportError:  # the validator package is optional for an executor-only install
        return None
    if not policies_dir.is_dir():
        return None
    policies = PolicySet.load(policies_dir)

    def context_for(call: ApprovedCall) -> ToolContext:
        policy = policies.get(call.policy_id)
        if policy is None:
            return ToolContext(call.workspace, frozenset(), limits)
        if os.path.realpath(policy.workspace_root) != os.path.realpath(call.workspace):
            raise ExecutionError(Reason.SANDBOX_VIOLATION, "workspace differs from policy")
        return ToolContext(call.workspace, frozenset(policy.http_hosts), limits)

    return context_for


def _run_executor(args: argparse.Namespace) -> int:
    from callgate.logging import configure_logging
    from executor.worker import ExecutorConfig, ExecutorWorker

    configure_logging()
    settings = Settings.from_env()
    limits = Limits()
    config = ExecutorConfig(
        bootstrap=settings.kafka_bootstrap,
        topics=settings.topics,
        signing_keys=settings.signing_key_map(),
        digest_key=digest_key_from(settings.signing_key()),
        executor_id=settings.worker_id,
        context_for=policy_context(settings.policies_dir, limits),
        limits=limits,
        instance_id=args.instance_id or os.environ.get("CALLGATE_EXECUTOR_INSTANCE_ID") or None,
        session_timeout_ms=args.session_timeout_ms,
        metrics_port=settings.metrics_port,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await ExecutorWorker(config).run(stop)

    asyncio.run(main())
    return 0


def _ledger_show(args: argparse.Namespace) -> int:
    from callgate.kafka import read_topic

    settings = Settings.from_env()
    records = asyncio.run(read_topic(settings.kafka_bootstrap, settings.topics.ledger))
    found = 0
    for record in records:
        if record.key != args.call_id.encode():
            continue
        entry = avro.decode(record.value, topic=record.topic, partition=record.partition, offset=record.offset)
        if isinstance(entry, LedgerEntry):
            # a ledger entry holds ids, phases and a keyed digest only: safe to print
            print(json.dumps({**dataclasses.asdict(entry), "offset": record.offset}, sort_keys=True))
            found += 1
    return 0 if found else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("executor", help="run the executor worker until SIGTERM")
    run.add_argument("--instance-id", default=None, help="static group membership id (KIP-345)")
    run.add_argument("--session-timeout-ms", type=int, default=10_000)
    run.set_defaults(func=_run_executor)

    led = subparsers.add_parser("ledger", help="inspect the executor's decision ledger")
    led_sub = led.add_subparsers(dest="ledger_command", required=True)
    show = led_sub.add_parser("show", help="print every ledger entry of one call id")
    show.add_argument("call_id")
    show.set_defaults(func=_ledger_show)
