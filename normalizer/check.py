"""`callgate check FILE [FILE...] --route ROUTE [--tools DIR] [--policy FILE]`: the embedded mode.

Decoder, adapter, accumulator and validator cores in one process, no broker.
Each FILE is raw SSE wire text for one attempt of one run, in order (a
disconnect followed by a retry is two files). Prints one JSON line per
item: ids, tool (its name when registered, else "unregistered"), final
state, reason class, byte count, and the provider event that decided it;
never the arguments. Stream anomalies that are not an item (a delta for an
unknown item, ...) are printed too, with "anomaly": true. Exit status 0
whenever it ran, whatever the verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from callgate.records import AttemptStarted, AuditRecord, DeadLetter, RawSseMessage, TerminalItem, TransportEnd
from callgate.errors import Reason
from callgate.settings import REPO_ROOT
from ingest.decoder import SseDecoder, SseLimitExceeded

from normalizer.accumulator import Limits, Output, RetainedBuffer, RunAccumulator
from normalizer.adapters import adapter_version

if TYPE_CHECKING:
    from validator.core import RunState, Validator

# The validator cores are imported where `check` runs, not when the CLI is built: its
# format checker compiles URI grammars (~1 s) that no worker but the validator needs.

DEFAULT_TOOLS = REPO_ROOT / "schemas" / "tools"
DEFAULT_POLICY = REPO_ROOT / "policies" / "demo.toml"
BASE_TIME_MS = 1_700_000_000_000  # fixed clock: check's output depends on the files only


@dataclass(frozen=True, slots=True)
class Attempt:
    records: list[AttemptStarted | RawSseMessage | TransportEnd]


def attempt_records(
    wire: bytes, *, run_id: str, attempt_id: str, attempt_number: int, route: str, tool_set: list[str],
    policy_id: str, start_ms: int, chunk_size: int = 0,
) -> list[AttemptStarted | RawSseMessage | TransportEnd]:
    """The records ingest would publish for one attempt that received `wire` and then hit end of stream."""
    version = adapter_version(route)
    records: list[AttemptStarted | RawSseMessage | TransportEnd] = [AttemptStarted(
        run_id=run_id, attempt_id=attempt_id, attempt_number=attempt_number, route=route,
        adapter_version=version, model="check", tool_set=list(tool_set), policy_id=policy_id, started_at=start_ms,
    )]
    decoder = SseDecoder()
    reason = Reason.TRANSPORT_EOF
    messages = []
    try:
        step = chunk_size or len(wire) or 1
        for at in range(0, len(wire), step):
            messages += decoder.feed(wire[at:at + step])
    except SseLimitExceeded as exc:
        messages += exc.dispatched
        reason = exc.reason
    end = decoder.close()
    for seq, message in enumerate(messages):
        records.append(RawSseMessage(
            run_id=run_id, attempt_id=attempt_id, seq=seq, route=route, adapter_version=version,
            received_at=start_ms + seq + 1, event=message.event, data=message.data,
            last_event_id=message.last_event_id or None, retry_ms=message.retry,
        ))
    records.append(TransportEnd(
        run_id=run_id, attempt_id=attempt_id, seq=len(messages), route=route, reason=reason.value,
        ended_at=start_ms + len(messages) + 1, bytes_received=len(wire), messages=len(messages),
        incomplete_message=end.incomplete,
    ))
    return records


def _tool_label(validator: Validator, name: str) -> str:
    return name if validator.registry.get(name) is not None else "unregistered"


def run_check(
    files: Sequence[Path], *, route: str, validator: Validator, tool_set: list[str] | None = None,
    policy_id: str | None = None, run_id: str | None = None, limits: Limits = Limits(), chunk_size: int = 0,
) -> list[dict]:
    """Every decision of one run whose attempts are `files`, as the JSON-able rows `check` prints."""
    run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
    tools = sorted(validator.registry.names) if tool_set is None else tool_set
    policy = policy_id or (sorted(validator.policies.ids)[0] if validator.policies.ids else "")
    from validator.core import RunState

    accumulator = RunAccumulator(run_id, limits=limits)
    state = RunState(run_id)
    rows: list[dict] = []
    for number, path in enumerate(files, start=1):
        records = attempt_records(
            Path(path).read_bytes(), run_id=run_id, attempt_id=f"att-{number}-{uuid.uuid4().hex[:8]}",
            attempt_number=number, route=route, tool_set=tools, policy_id=policy,
            start_ms=BASE_TIME_MS + number * 1_000_000, chunk_size=chunk_size,
        )
        for record in records:
            for out in accumulator.feed(record):
                row = _row(out, validator, state)
                if row is not None:
                    rows.append(row)
    return rows


def _row(out: Output, validator: Validator, state: RunState) -> dict | None:
    if isinstance(out, (AuditRecord, RetainedBuffer)):
        return None
    if isinstance(out, TerminalItem):
        decision = validator.decide(out, state, now_ms=out.terminal_at)
        reason = decision.reason.value if hasattr(decision, "reason") else None
        return {
            "run_id": out.run_id, "attempt_id": out.attempt_id, "response_id": out.response_id,
            "item_id": out.item_id, "call_id": out.call_id, "tool": _tool_label(validator, out.tool_name),
            "state": decision.state.value, "reason": reason, "bytes": len(out.arguments),
            "provider_event": out.provider_event,
        }
    assert isinstance(out, DeadLetter)
    row = {
        "run_id": out.run_id, "attempt_id": out.attempt_id, "response_id": out.response_id,
        "item_id": out.item_id, "call_id": out.call_id, "tool": out.tool_category, "state": out.state,
        "reason": out.reason, "bytes": out.byte_count, "provider_event": out.last_provider_event,
    }
    if out.detail_code:
        row["detail_code"] = out.detail_code
    if out.call_id is None:
        row["anomaly"] = True
    return row


def load_validator(tools: Path, policy: Path) -> Validator:
    from validator.core import Validator
    from validator.policy import PolicySet
    from validator.registry import ToolRegistry

    return Validator(ToolRegistry.load_dir(tools), PolicySet.load(policy))


def _run(args: argparse.Namespace) -> int:
    validator = load_validator(Path(args.tools), Path(args.policy))
    tool_set = [t for t in args.tool_set.split(",") if t] if args.tool_set else None
    try:
        rows = run_check([Path(f) for f in args.files], route=args.route, validator=validator,
                         tool_set=tool_set, policy_id=args.policy_id, chunk_size=args.chunk_size)
    except OSError as exc:
        print(f"check: cannot read input: {exc.strerror}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row, separators=(",", ":")))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser("check", help="run decoder, adapter, accumulator and validator on SSE files")
    check.add_argument("files", nargs="+", metavar="FILE", help="raw SSE, one file per attempt, in order")
    check.add_argument("--route", required=True, help="e.g. openai-responses, anthropic-messages, openai-chat")
    check.add_argument("--tools", default=str(DEFAULT_TOOLS), help="tool schema directory")
    check.add_argument("--policy", default=str(DEFAULT_POLICY), help="policy file (or directory)")
    check.add_argument("--tool-set", help="comma-separated tools registered for the run (default: all)")
    check.add_argument("--policy-id", help="policy id for the run (default: the first loaded)")
    check.add_argument("--chunk-size", type=int, default=0, help="feed the decoder this many bytes at a time")
    check.set_defaults(func=_run)

    worker = subparsers.add_parser("normalizer", help="run the normalizer worker until SIGTERM")
    worker.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from normalizer.worker import main

    return main()
