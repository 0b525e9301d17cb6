"""Helpers for the normalizer tests: records as ingest would publish them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from callgate.records import AttemptStarted, RawSseMessage, TerminalItem, TransportEnd, DeadLetter
from normalizer.adapters import adapter_version
from normalizer.check import attempt_records

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
REAL = Path("/work/shared/fixtures-real")
TOOLS = ["read_file", "write_file", "list_dir", "run_command", "http_request"]


def expect_files() -> list[Path]:
    return sorted(FIXTURES.glob("*/*.expect.json"))


def load_expect(path: Path) -> dict:
    return json.loads(path.read_text())


def fixture_run(expect: dict, folder: Path, run_id: str | None = None, *, start_ms: int = 1_000_000,
                chunk_size: int = 0) -> list:
    """Every record of the fixture's run, attempt after attempt."""
    run_id = run_id or f"run-{uuid.uuid4().hex[:10]}"
    records: list = []
    for number, name in enumerate(expect["attempts"], start=1):
        records += attempt_records(
            (folder / name).read_bytes(), run_id=run_id, attempt_id=f"{run_id}-a{number}", attempt_number=number,
            route=expect["route"], tool_set=expect["tool_set"], policy_id=expect["policy_id"],
            start_ms=start_ms + number * 10_000, chunk_size=chunk_size,
        )
    return records


def messages_records(messages: list[tuple[str, str]], route: str, run_id: str = "run-x", attempt_id: str = "att-1",
                     *, end: str | None = "transport_eof", tool_set: list[str] | None = None) -> list:
    """Records for (event, data) messages, with an AttemptStarted and (unless end is None) a TransportEnd."""
    version = adapter_version(route)
    records: list = [AttemptStarted(run_id, attempt_id, 1, route, version, "m", tool_set or TOOLS, "demo", 0)]
    for seq, (event, data) in enumerate(messages):
        records.append(RawSseMessage(run_id, attempt_id, seq, route, version, seq + 1, event, data))
    if end is not None:
        records.append(TransportEnd(run_id, attempt_id, len(messages), route, end, len(messages) + 1, 0,
                                    len(messages)))
    return records


def chunks_messages(path: Path, route: str) -> list[tuple[str, str]]:
    """A Vercel *.chunks.txt (JSON lines, SSE framing stripped) back into (event, data) messages."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:  # kept as recorded: malformed provider JSON is the adapter's to classify
            out.append(("message", line))
            continue
        event = obj.get("type", "message") if route != "openai-chat" and isinstance(obj, dict) else "message"
        out.append((event, line))
    if route == "openai-chat":
        out.append(("message", "[DONE]"))  # the recorder stripped it
    return out


def cassette_bodies(path: Path) -> list[bytes]:
    import yaml

    data = yaml.safe_load(path.read_text())
    return [i["response"]["body"]["string"].encode() for i in data["interactions"]
            if isinstance(i.get("response", {}).get("body", {}).get("string"), str)]


def split(outputs: list) -> tuple[list[TerminalItem], list[DeadLetter], list[DeadLetter]]:
    """(terminal items, quarantined items, anomalies)."""
    terminals = [o for o in outputs if isinstance(o, TerminalItem)]
    dead = [o for o in outputs if isinstance(o, DeadLetter)]
    return terminals, [d for d in dead if d.call_id is not None], [d for d in dead if d.call_id is None]
