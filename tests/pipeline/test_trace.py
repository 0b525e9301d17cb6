"""The trace view is built from audit records alone and never needs content."""

from __future__ import annotations

from html.parser import HTMLParser

from callgate.records import AuditRecord
from callgate.trace import build_timeline, render_html, render_text


def audit(stage: str, state: str, at: int, *, item: str | None = "i1", call: str | None = None,
          reason: str | None = None, run: str = "run-1", event: str | None = None) -> AuditRecord:
    return AuditRecord(
        observed_at=at, stage=stage, run_id=run, attempt_id="a1" if item else None,
        response_id="r1" if item else None, item_id=item, call_id=call, model_route="openai-responses",
        stream_event=event, tool_name="write_file" if item or call else None, buffer_bytes=42 if item else None,
        terminal_seen=state != "QUARANTINED", json_status=None, trailing_data=None, schema_status=None,
        policy_status=None, execution_state=None, state=state, error_class=reason,
    )


def test_later_stages_join_the_item_by_call_id_and_final_state_is_last():
    records = [
        audit("executor", "EXECUTED", 30, item=None, call="c1"),
        audit("normalizer", "ITEM_TERMINAL", 10, call="c1", event="response.output_item.done"),
        audit("validator", "POLICY_APPROVED", 20, call="c1"),
        audit("normalizer", "QUARANTINED", 15, item="i2", reason="stream_error"),
        audit("normalizer", "ITEM_TERMINAL", 5, run="other-run", call="cX"),
        audit("ingest", "transport_eof", 40, item=None),
    ]
    timeline = build_timeline("run-1", records)
    assert [i.item_id for i in timeline.items] == ["i1", "i2"]
    first, second = timeline.items
    assert [s.stage for s in first.steps] == ["normalizer", "validator", "executor"]
    assert first.final_state == "EXECUTED" and first.final_reason is None
    assert second.final_state == "QUARANTINED" and second.final_reason == "stream_error"
    assert [s.state for s in timeline.run_events] == ["transport_eof"]

    text = render_text(timeline)
    assert "final=EXECUTED" in text and "final=QUARANTINED stream_error" in text
    assert "other-run" not in text and "cX" not in text


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_html_is_self_contained_and_escapes_outside_values():
    hostile = "<script>alert(1)</script>"
    records = [audit("normalizer", "QUARANTINED", 1, item=hostile, reason="stream_error")]
    page = render_html(build_timeline("run-1", records))
    parser = _Collect()
    parser.feed(page)
    assert "script" not in parser.tags
    assert not any(t in parser.tags for t in ("link", "img", "iframe"))
    assert hostile in "".join(parser.text)
    assert "QUARANTINED" in page
