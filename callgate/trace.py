"""One run's timeline, built from its audit records alone.

Pure functions: audit records in, a timeline out, rendered as terminal text
or as a self-contained HTML page (no scripts, no external assets). Audit
records are sanitized by contract, and every value is still HTML-escaped
because ids and route names come from outside.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from callgate.records import AuditRecord
from callgate.states import FINAL_STATES, ItemState


@dataclass(frozen=True, slots=True)
class Step:
    observed_at: int
    stage: str
    state: str
    reason: str | None
    stream_event: str | None


@dataclass(slots=True)
class ItemTimeline:
    key: str  # call id when known, else attempt/response/item
    attempt_id: str | None
    response_id: str | None
    item_id: str | None
    call_id: str | None
    tool: str | None
    buffer_bytes: int | None
    steps: list[Step] = field(default_factory=list)

    @property
    def final_state(self) -> str | None:
        finals = [s.state for s in self.steps if s.state in FINAL_STATES]
        return finals[-1] if finals else None

    @property
    def final_reason(self) -> str | None:
        for step in reversed(self.steps):
            if step.state in FINAL_STATES:
                return step.reason
        return None


@dataclass(slots=True)
class RunTimeline:
    run_id: str
    route: str | None
    items: list[ItemTimeline]
    run_events: list[Step]  # records about the run that name no item (e.g. transport ends)


def _item_key(record: AuditRecord) -> str | None:
    if record.item_id is None and record.call_id is None:
        return None
    return f"{record.attempt_id}/{record.response_id}/{record.item_id}"


def build_timeline(run_id: str, records: Iterable[AuditRecord]) -> RunTimeline:
    ordered = sorted((r for r in records if r.run_id == run_id), key=lambda r: r.observed_at)
    items: dict[str, ItemTimeline] = {}
    by_call: dict[str, ItemTimeline] = {}
    run_events: list[Step] = []
    route: str | None = None
    for record in ordered:
        route = route or record.model_route
        step = Step(record.observed_at, record.stage, record.state, record.error_class, record.stream_event)
        # later stages may only know the call id; attach them to the item that minted it
        timeline = by_call.get(record.call_id) if record.call_id else None
        if timeline is None:
            key = _item_key(record)
            if key is None:
                run_events.append(step)
                continue
            timeline = items.get(key)
            if timeline is None:
                timeline = ItemTimeline(
                    key=key,
                    attempt_id=record.attempt_id,
                    response_id=record.response_id,
                    item_id=record.item_id,
                    call_id=record.call_id,
                    tool=record.tool_name,
                    buffer_bytes=record.buffer_bytes,
                )
                items[key] = timeline
        if record.call_id and timeline.call_id is None:
            timeline.call_id = record.call_id
        if record.call_id:
            by_call[record.call_id] = timeline
        timeline.tool = timeline.tool or record.tool_name
        if record.buffer_bytes is not None:
            timeline.buffer_bytes = record.buffer_bytes
        timeline.steps.append(step)
    return RunTimeline(run_id=run_id, route=route, items=list(items.values()), run_events=run_events)


def _clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def render_text(timeline: RunTimeline) -> str:
    lines = [f"run {timeline.run_id}  route={timeline.route or '-'}  items={len(timeline.items)}"]
    for step in timeline.run_events:
        lines.append(f"  {_clock(step.observed_at)}  [{step.stage}] {step.state} {step.reason or ''}".rstrip())
    for item in timeline.items:
        final = item.final_state or "OPEN"
        lines.append(
            f"- item {item.item_id} (attempt {item.attempt_id}, call {item.call_id or '-'}) "
            f"tool={item.tool or '-'} bytes={item.buffer_bytes if item.buffer_bytes is not None else '-'} "
            f"final={final} {item.final_reason or ''}".rstrip()
        )
        start = item.steps[0].observed_at if item.steps else 0
        for step in item.steps:
            lines.append(
                f"    +{step.observed_at - start:>6} ms  {_clock(step.observed_at)}  [{step.stage}] "
                f"{step.state}{' ' + step.reason if step.reason else ''}"
                f"{'  <' + step.stream_event + '>' if step.stream_event else ''}"
            )
    return "\n".join(lines) + "\n"


_STATE_COLOURS = {
    ItemState.EXECUTED: "#1b7f3b",
    ItemState.POLICY_APPROVED: "#1b7f3b",
    ItemState.PENDING_APPROVAL: "#9a6700",
    ItemState.FAILED: "#b35900",
    ItemState.IN_DOUBT: "#8250df",
    ItemState.REJECTED: "#cf222e",
    ItemState.QUARANTINED: "#cf222e",
}


def render_html(timeline: RunTimeline) -> str:
    e = html.escape
    rows: list[str] = []
    for item in timeline.items:
        final = item.final_state or "OPEN"
        colour = _STATE_COLOURS.get(final, "#57606a")  # type: ignore[call-overload]
        steps = "".join(
            f"<li><time>{e(_clock(s.observed_at))}</time> <b>{e(s.stage)}</b> "
            f"<span class=st>{e(s.state)}</span>"
            f"{' <i>' + e(s.reason) + '</i>' if s.reason else ''}"
            f"{' <code>' + e(s.stream_event) + '</code>' if s.stream_event else ''}</li>"
            for s in item.steps
        )
        rows.append(
            f"<section><h2>item {e(item.item_id or '-')} "
            f"<span class=badge style='background:{colour}'>{e(final)}</span> "
            f"{e(item.final_reason or '')}</h2>"
            f"<p>attempt {e(item.attempt_id or '-')} &middot; response {e(item.response_id or '-')} &middot; "
            f"call {e(item.call_id or '-')} &middot; tool {e(item.tool or '-')} &middot; "
            f"{e(str(item.buffer_bytes) if item.buffer_bytes is not None else '-')} bytes</p>"
            f"<ol>{steps}</ol></section>"
        )
    run_rows = "".join(
        f"<li><time>{e(_clock(s.observed_at))}</time> <b>{e(s.stage)}</b> {e(s.state)} {e(s.reason or '')}</li>"
        for s in timeline.run_events
    )
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>callgate trace {e(timeline.run_id)}</title>"
        "<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:70em}"
        "section{border:1px solid #d0d7de;border-radius:6px;padding:.5em 1em;margin:1em 0}"
        ".badge{color:#fff;border-radius:1em;padding:0 .6em;font-size:80%}"
        "time{color:#57606a;font-family:monospace}.st{font-family:monospace}</style></head><body>"
        f"<h1>run {e(timeline.run_id)}</h1><p>route {e(timeline.route or '-')} &middot; "
        f"{len(timeline.items)} items</p>"
        f"{'<h2>run events</h2><ol>' + run_rows + '</ol>' if run_rows else ''}"
        f"{''.join(rows)}</body></html>\n"
    )
