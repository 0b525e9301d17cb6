"""`callgate ingest`, `callgate upstream` and `callgate submit`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
import uuid
from pathlib import Path


def _run_ingest(args: argparse.Namespace) -> int:
    from callgate.settings import Settings
    from ingest.attempt import RetryPolicy
    from ingest.worker import IngestConfig, StreamTimeouts, main

    settings = Settings.from_env()
    config = IngestConfig.from_settings(
        settings,
        max_concurrent_runs=args.max_runs,
        timeouts=StreamTimeouts(connect_s=args.connect_timeout, idle_s=args.idle_timeout, total_s=args.total_timeout),
        policy=RetryPolicy(max_attempts=args.max_attempts, base_delay_s=args.backoff, max_delay_s=args.backoff_cap),
    )
    return main(config)


def _run_upstream(args: argparse.Namespace) -> int:
    from ingest.upstream import LocalUpstream

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with LocalUpstream(Path(args.fixtures), host=args.host, port=args.port) as upstream:
            print(upstream.base_url, flush=True)  # alone on its line, for scripts to read
            await stop.wait()

    asyncio.run(serve())
    return 0


def _run_submit(args: argparse.Namespace) -> int:
    from callgate import avro
    from callgate.kafka import make_producer
    from callgate.records import RunRequest
    from callgate.settings import Settings

    settings = Settings.from_env()
    if args.namespace:
        settings = settings.model_copy(update={"topic_namespace": args.namespace})
    body = Path(args.body).read_bytes() if args.body else b'{"stream": true}'
    request = RunRequest(
        run_id=args.run_id or f"run-{uuid.uuid4().hex[:16]}", route=args.route, model=args.model,
        upstream_url=args.url, request_body=body, tool_set=_tool_names(args.tools), policy_id=args.policy,
        submitted_at=int(time.time() * 1000), api_key_env=args.api_key_env,
    )

    async def send() -> None:
        producer = await make_producer(settings.kafka_bootstrap)
        try:
            await producer.send_and_wait(settings.topics.runs, avro.encode(request), key=request.run_id.encode())
        finally:
            await producer.stop()

    asyncio.run(send())
    print(request.run_id)
    return 0


def _tool_names(values: list[str] | None) -> list[str]:
    """`--tools a,b` and `--tools a b` both work; order kept, duplicates dropped."""
    names = (name.strip() for value in values or () for name in value.split(","))
    return list(dict.fromkeys(name for name in names if name))


def register(subparsers: argparse._SubParsersAction) -> None:
    ingest = subparsers.add_parser("ingest", help="run the ingest worker until SIGTERM")
    ingest.add_argument("--max-runs", type=int, default=8, help="runs streamed at once by this worker")
    ingest.add_argument("--connect-timeout", type=float, default=10.0)
    ingest.add_argument("--idle-timeout", type=float, default=60.0, help="longest silence between bytes, s")
    ingest.add_argument("--total-timeout", type=float, default=900.0, help="whole attempt, s")
    ingest.add_argument("--max-attempts", type=int, default=4)
    ingest.add_argument("--backoff", type=float, default=0.5, help="first retry delay, s")
    ingest.add_argument("--backoff-cap", type=float, default=20.0, help="longest retry delay, s")
    ingest.set_defaults(func=_run_ingest)

    upstream = subparsers.add_parser("upstream", help="serve recorded SSE fixtures over HTTP on 127.0.0.1")
    upstream.add_argument("--fixtures", required=True, help="directory of fixture files")
    upstream.add_argument("--port", type=int, default=8765)
    upstream.add_argument("--host", default="127.0.0.1")
    upstream.set_defaults(func=_run_upstream)

    submit = subparsers.add_parser("submit", help="write one RunRequest to the runs topic; prints the run id")
    submit.add_argument("--route", required=True)
    submit.add_argument("--url", required=True, help="upstream URL to stream from")
    submit.add_argument("--tools", nargs="*", help="tool names allowed in this run: a,b (or a b)")
    submit.add_argument("--policy", default="demo", help="policy id")
    submit.add_argument("--model", default="demo")
    submit.add_argument("--body", help="file holding the request body (default: a minimal JSON)")
    submit.add_argument("--api-key-env", help="name of the env var that holds the API key")
    submit.add_argument("--run-id")
    submit.add_argument("--namespace", help="topic namespace (default: CALLGATE_TOPIC_NAMESPACE)")
    submit.set_defaults(func=_run_submit)


