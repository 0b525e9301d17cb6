"""The recorded provider streams in ../shared/fixtures-real through the adapters and the accumulator."""

from __future__ import annotations

import json

import pytest

from callgate.records import AuditRecord
from normalizer.accumulator import RunAccumulator
from normalizer.check import attempt_records

from tests.normalizer.support import REAL, cassette_bodies, chunks_messages, messages_records, split

pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason="no ../shared/fixtures-real here")


def run_messages(messages, route):
    acc = RunAccumulator("run-real")
    out = []
    for record in messages_records(messages, route):
        out += acc.feed(record)
    return out


def run_wire(wire: bytes, route: str, run_id: str = "run-real"):
    acc = RunAccumulator(run_id)
    out = []
    for record in attempt_records(wire, run_id=run_id, attempt_id="a1", attempt_number=1, route=route,
                                  tool_set=["weather"], policy_id="demo", start_ms=0):
        out += acc.feed(record)
    return out


# (file, route, terminal tool names in order, quarantined reasons, anomaly reasons)
CHUNKS = [
    ("openai-responses/vercel-azure-tool-call.1.chunks.txt", "openai-responses", ["weather"], [], []),
    ("openai-responses/vercel-openai-error.1.chunks.txt", "openai-responses", [], [], ["stream_error"]),
    ("openai-responses/vercel-lmstudio-tool-call.1.chunks.txt", "openai-responses", None, [], []),
    ("openai-responses/vercel-github-copilot-item-id-rotation.1.chunks.txt", "openai-responses", [], [], []),
    # its recorded response.created line is cut short (unbalanced braces): the attempt fails closed at once
    ("openai-responses/vercel-parallel-tool-call-wrapper.1.chunks.txt", "openai-responses", [], [],
     ["malformed_provider_event"]),
    ("anthropic/vercel-anthropic-text-then-tool.chunks.txt", "anthropic-messages", ["json"], [], []),
    ("anthropic/vercel-anthropic-tool-no-args.chunks.txt", "anthropic-messages", None, [], []),
    ("anthropic/vercel-anthropic-spliced-message-start.chunks.txt", "anthropic-messages", ["test-tool"],
     ["stream_ended_before_terminal"], []),
    ("anthropic/vercel-anthropic-duplicate-message-start.chunks.txt", "anthropic-messages", [], [], []),
    ("openai-chat/vercel-deepseek-tool-call.chunks.txt", "openai-chat", None, [], []),
    ("openai-chat/vercel-groq-tool-call.chunks.txt", "openai-chat", None, [], []),
    ("openai-chat/vercel-mistral-tool-call-no-index.chunks.txt", "openai-chat", ["weather"], [], []),
    ("openai-chat/vercel-mistral-incremental-tool-call.chunks.txt", "openai-chat", ["webSearchTool"], [], []),
    ("openai-chat/vercel-xai-tool-call.chunks.txt", "openai-chat", None, [], []),
]


@pytest.mark.parametrize("name,route,tools,quarantined,anomalies", CHUNKS, ids=[c[0].split("/")[1] for c in CHUNKS])
def test_recorded_chunks(name, route, tools, quarantined, anomalies) -> None:
    path = REAL / name
    if not path.exists():
        pytest.skip("fixture absent")
    terminals, dead, odd = split(run_messages(chunks_messages(path, route), route))
    if tools is None:
        assert len(terminals) == 1
    else:
        assert [t.tool_name for t in terminals] == tools
    assert [d.reason for d in dead] == quarantined
    assert [d.reason for d in odd] == anomalies
    for t in terminals:  # every recorded terminal buffer is exactly one JSON value
        assert isinstance(json.loads(t.arguments), dict)


def test_multistep_responses_are_keyed_by_response() -> None:
    path = REAL / "openai-responses/vercel-openai-reasoning-multistep-function-calls.1.chunks.txt"
    terminals, dead, odd = split(run_messages(chunks_messages(path, "openai-responses"), "openai-responses"))
    # 4 concatenated responses, 3 of them with one function call each (the last is text)
    assert len(terminals) == 3 and not dead and not odd
    assert len({t.response_id for t in terminals}) == 3
    assert len({t.call_id for t in terminals}) == 3


def test_anthropic_no_args_tool_gets_its_declared_empty_input() -> None:
    path = REAL / "anthropic/vercel-anthropic-tool-no-args.chunks.txt"
    terminals, _, _ = split(run_messages(chunks_messages(path, "anthropic-messages"), "anthropic-messages"))
    assert terminals[0].arguments == b"{}"


def test_spliced_message_start_never_merges_the_two_generations() -> None:
    path = REAL / "anthropic/vercel-anthropic-spliced-message-start.chunks.txt"
    out = run_messages(chunks_messages(path, "anthropic-messages"), "anthropic-messages")
    terminals, dead, _ = split(out)
    assert terminals[0].provider_call_id == "toolu_second"
    assert json.loads(terminals[0].arguments) == {"value": "Sparkle Day"}
    assert dead[0].detail_code == "response_superseded" and dead[0].byte_count == len('{"value":"Spark')


def test_lmstudio_arguments_only_on_done_are_adopted() -> None:
    path = REAL / "openai-responses/vercel-lmstudio-tool-call.1.chunks.txt"
    terminals, _, _ = split(run_messages(chunks_messages(path, "openai-responses"), "openai-responses"))
    assert terminals[0].provider_event == "response.output_item.done"
    assert isinstance(json.loads(terminals[0].arguments), dict)


def test_unknown_event_types_are_counted_in_the_attempt_summary() -> None:
    path = REAL / "openai-responses/vercel-github-copilot-item-id-rotation.1.chunks.txt"
    out = run_messages(chunks_messages(path, "openai-responses"), "openai-responses")
    summary = [o for o in out if isinstance(o, AuditRecord) and o.extra.get("kind") == "attempt_summary"]
    assert len(summary) == 1 and int(summary[0].extra["text_bytes"]) > 0


RAW_SSE = [
    ("openai-chat/openai-python-f82268f2fefd.sse", "openai-chat", ["GetWeatherArgs", "get_stock_price"], []),
    ("openai-chat/openai-python-2018feb66ae1.sse", "openai-chat", ["get_weather"], []),
    ("openai-chat/openai-python-a247c49c5fcd.sse", "openai-chat", ["get_weather"], []),
    ("openai-chat/vercel-anthropic-compat-tool-call-index1.sse", "openai-chat", ["read_file"], []),
    ("anthropic/anthropic-python-tool_use_response.sse", "anthropic-messages", None, []),
    # no content_block_stop for the tool block, and the final message_stop is unterminated: quarantined
    ("anthropic/anthropic-python-incomplete_partial_json_max_tokens.sse", "anthropic-messages", [],
     ["stream_ended_before_terminal"]),
]


@pytest.mark.parametrize("name,route,tools,quarantined", RAW_SSE, ids=[c[0].split("/")[1] for c in RAW_SSE])
def test_recorded_raw_sse(name, route, tools, quarantined) -> None:
    path = REAL / name
    if not path.exists():
        pytest.skip("fixture absent")
    terminals, dead, odd = split(run_wire(path.read_bytes(), route))
    if tools is None:
        assert len(terminals) == 1
    else:
        assert [t.tool_name for t in terminals] == tools
    assert [d.reason for d in dead] == quarantined and not odd


def test_parallel_chat_calls_keep_separate_buffers() -> None:
    path = REAL / "openai-chat/openai-python-f82268f2fefd.sse"
    terminals, _, _ = split(run_wire(path.read_bytes(), "openai-chat"))
    values = [json.loads(t.arguments) for t in terminals]
    assert "city" in values[0] and "ticker" in values[1]


@pytest.mark.parametrize("name,route,interactions", [
    ("openai-responses/pydantic-ai-bedrock-mantle-reused-call-ids-stream.yaml", "openai-responses", None),
    ("openai-responses/pydantic-ai-deepseek-responses-function-tool-stream.yaml", "openai-responses", None),
    ("groq/pydantic-ai-groq-tool_use_failed_error_streaming.yaml", "openai-chat", None),
])
def test_recorded_cassettes(name, route, interactions) -> None:
    path = REAL / name
    if not path.exists():
        pytest.skip("fixture absent")
    bodies = cassette_bodies(path)
    assert bodies
    results = [split(run_wire(body, route, run_id=f"run-{n}")) for n, body in enumerate(bodies)]
    if "groq" in name:
        # first stream: a mid-stream `event: error` (tool_use_failed) with nothing open: one classified anomaly
        assert [d.reason for d in results[0][2]] == ["stream_error"]
        assert results[0][2][0].detail_code == "tool_use_failed"
    else:
        assert sum(len(r[0]) for r in results) >= 1
        for terminals, dead, odd in results:
            assert not dead and not odd
            for t in terminals:
                assert isinstance(json.loads(t.arguments), dict)
    if "mantle" in name:
        provider_ids = [t.provider_call_id for r in results for t in r[0]]
        call_ids = [t.call_id for r in results for t in r[0]]
        # the provider's short, response-scoped ids (call_0, call_1) are kept, never used as our identity
        assert all(p is not None and p.startswith("call_") for p in provider_ids)
        assert len(set(call_ids)) == len(call_ids) and not set(call_ids) & set(provider_ids)
