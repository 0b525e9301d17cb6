"""The accumulator core: lifecycle classification, attempts, limits, and properties over interleavings."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from callgate.records import AttemptStarted, AuditRecord, DeadLetter, RawSseMessage, TerminalItem, TransportEnd
from normalizer.accumulator import Limits, Normalizer, RetainedBuffer, RunAccumulator
from normalizer.adapters import adapter_version
from normalizer.check import attempt_records

from tests.normalizer.support import FIXTURES, TOOLS, messages_records, split

R = "openai-responses"


def ev(kind: str, **body) -> tuple[str, str]:
    return kind, json.dumps({"type": kind, **body})


def created(rid="resp_1"):
    return ev("response.created", response={"id": rid})


def added(item_id, name="read_file", call_id=None):
    return ev("response.output_item.added", item={"type": "function_call", "id": item_id, "name": name,
                                                  "call_id": call_id or f"call_{item_id}", "arguments": ""})


def delta(item_id, text):
    return ev("response.function_call_arguments.delta", item_id=item_id, delta=text)


def done(item_id, arguments=None, name="read_file"):
    item = {"type": "function_call", "id": item_id, "name": name, "call_id": f"call_{item_id}"}
    if arguments is not None:
        item["arguments"] = arguments
    return ev("response.output_item.done", item=item)


def completed(rid="resp_1"):
    return ev("response.completed", response={"id": rid})


def feed(records, acc=None, **kw):
    acc = acc or RunAccumulator("run-x", **kw)
    out = []
    for record in records:
        out += acc.feed(record)
    return out


ARGS = '{"path": "src/app.py"}'


def test_terminal_item_carries_the_whole_buffer_and_the_closing_event() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", ARGS[:5]), delta("fc_1", ARGS[5:]),
                                 done("fc_1", ARGS), completed()], R))
    terminals, dead, odd = split(out)
    assert [t.arguments for t in terminals] == [ARGS.encode()] and not dead and not odd
    t = terminals[0]
    assert (t.provider_event, t.response_id, t.item_id, t.provider_call_id) == (
        "response.output_item.done", "resp_1", "fc_1", "call_fc_1")
    assert t.call_id.startswith("cg_") and t.tool_set == TOOLS and t.policy_id == "demo"
    assert t.adapter_version == adapter_version(R)


def test_text_done_never_completes_a_call() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", ARGS),
                                 ev("response.output_text.done", item_id="fc_1", text="x"), completed()], R))
    terminals, dead, _ = split(out)
    assert not terminals
    assert [(d.reason, d.detail_code) for d in dead] == [("stream_ended_before_terminal", "response_finished")]


def test_delta_after_terminal_and_second_done_are_classified_once_each() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", ARGS), done("fc_1"),
                                 delta("fc_1", "{}"), delta("fc_1", "{}"), added("fc_2"), delta("fc_2", ARGS),
                                 done("fc_2"), done("fc_2"), completed()], R))
    terminals, dead, odd = split(out)
    assert len(terminals) == 2 and not dead
    assert [o.reason for o in odd] == ["delta_after_terminal", "duplicate_item"]
    assert odd[0].byte_count == 2


def test_delta_for_unknown_item_is_an_anomaly_with_its_size() -> None:
    out = feed(messages_records([created(), delta("fc_9", "abc")], R))
    _, _, odd = split(out)
    assert [(o.reason, o.byte_count, o.item_id) for o in odd] == [("delta_for_unknown_item", 3, "fc_9")]


def test_id_reused_by_a_new_item_quarantines_the_open_one() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", '{"pa'), added("fc_1", name="write_file"),
                                 delta("fc_1", 'th": "x"}'), done("fc_1"), completed()], R))
    terminals, dead, odd = split(out)
    assert not terminals and not odd
    assert [(d.reason, d.byte_count) for d in dead] == [("id_reuse", 4)]


def test_same_provider_call_id_twice_in_a_response_is_id_reuse() -> None:
    out = feed(messages_records([created(), added("fc_1", call_id="call_0"), added("fc_2", call_id="call_0"),
                                 delta("fc_1", ARGS), delta("fc_2", ARGS), done("fc_1"), done("fc_2"), completed()], R))
    terminals, dead, _ = split(out)
    assert [t.item_id for t in terminals] == ["fc_1"]
    assert [(d.item_id, d.reason, d.detail_code) for d in dead] == [("fc_2", "id_reuse", "provider_call_id")]


def test_size_cap_quarantines_and_swallows_the_rest() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", "x" * 60), delta("fc_1", "x" * 60),
                                 delta("fc_1", "x"), done("fc_1"), completed()], R), limits=Limits(max_item_bytes=100))
    terminals, dead, odd = split(out)
    assert not terminals and not odd
    assert [(d.reason, d.byte_count) for d in dead] == [("item_too_large", 120)]


def test_done_arguments_that_contradict_the_deltas_are_quarantined() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", ARGS), done("fc_1", '{"path": "/etc"}'),
                                 completed()], R))
    _, dead, _ = split(out)
    assert [(d.reason, d.detail_code) for d in dead] == [("malformed_provider_event", "arguments_mismatch")]


def test_transport_end_and_idle_marker_quarantine_open_items() -> None:
    msgs = [created(), added("fc_1"), delta("fc_1", '{"pa')]
    _, dead, _ = split(feed(messages_records(msgs, R, end="transport_disconnect")))
    assert [(d.reason, d.detail_code, d.byte_count) for d in dead] == [
        ("stream_ended_before_terminal", "transport_disconnect", 4)]
    acc = RunAccumulator("run-x", limits=Limits(idle_deadline_ms=1000))
    feed(messages_records(msgs, R, end=None), acc)
    assert not acc.idle(500) and acc.idle(1003)
    _, dead, _ = split(acc.feed(TransportEnd("run-x", "att-1", -1, R, "run_idle_deadline", 1003, 0, 0)))
    assert [d.reason for d in dead] == ["run_idle_deadline"] and not acc.open
    assert acc.feed(TransportEnd("run-x", "att-1", -1, R, "run_idle_deadline", 1004, 0, 0)) == []  # a second marker


def test_new_attempt_gets_new_accumulators_and_the_old_open_item_is_quarantined() -> None:
    first = messages_records([created(), added("fc_1"), delta("fc_1", '{"path": "a')], R, attempt_id="att-1", end=None)
    second = messages_records([created(), added("fc_1"), delta("fc_1", '.txt"}'), done("fc_1"), completed()], R,
                              attempt_id="att-2")
    out = feed(first + second)
    terminals, dead, _ = split(out)
    assert [(d.attempt_id, d.reason, d.detail_code) for d in dead] == [
        ("att-1", "stream_ended_before_terminal", "attempt_superseded")]
    # never spliced: the second attempt's buffer holds only its own bytes
    assert [(t.attempt_id, t.arguments) for t in terminals] == [("att-2", b'.txt"}')]
    assert dead[0].call_id != terminals[0].call_id


def test_records_of_an_attempt_without_state_are_classified() -> None:
    acc = RunAccumulator("run-x")
    out = acc.feed(RawSseMessage("run-x", "att-9", 0, R, "v", 1, "message", "{}"))
    assert [(o.reason, o.attempt_id) for o in out] == [("unknown_attempt", "att-9")]
    assert acc.feed(TransportEnd("run-x", "att-9", 1, R, "transport_eof", 2, 0, 0)) == []


def test_sequence_gap_and_duplicates() -> None:
    recs = messages_records([created(), added("fc_1"), delta("fc_1", "{"), delta("fc_1", "x"), delta("fc_1", "}")],
                            R, end=None)
    skipped = [recs[0], recs[1], recs[2], recs[3], recs[3], recs[5]]  # seq 2 twice, then seq 3 missing
    _, dead, _ = split(feed(skipped))
    assert [(d.reason, d.detail_code) for d in dead] == [("stream_error", "seq_gap")]


def test_stream_error_stops_the_attempt_and_later_events_are_only_counted() -> None:
    msgs = [created(), added("fc_1"), delta("fc_1", "{"), ev("error", error={"code": "server_error"}),
            added("fc_2"), delta("fc_2", ARGS), done("fc_2"), completed()]
    out = feed(messages_records(msgs, R))
    terminals, dead, _ = split(out)
    assert not terminals and [(d.reason, d.detail_code) for d in dead] == [("stream_error", "server_error")]
    summary = [o for o in out if isinstance(o, AuditRecord) and o.extra.get("kind") == "attempt_summary"]
    assert summary[0].extra["after_error"] == "4"


def test_malformed_provider_json_is_a_stream_outcome_not_a_crash() -> None:
    out = feed(messages_records([created(), added("fc_1"), ("response.output_item.done", '{"type": "resp')], R))
    _, dead, _ = split(out)
    assert [(d.reason, d.detail_code) for d in dead] == [("malformed_provider_event", "invalid_json")]


def test_unknown_route_is_classified() -> None:
    rec = AttemptStarted("run-x", "att-1", 1, "gemini-native", "?", "m", TOOLS, "demo", 0)
    out = feed([rec, RawSseMessage("run-x", "att-1", 0, "gemini-native", "?", 1, "message", "{}")])
    assert [o.reason for o in out if isinstance(o, DeadLetter)] == ["unknown_route"]


SECRET = "TOPSECRET-4f1d"


def test_no_arguments_in_dead_letters_audit_or_unknown_names() -> None:
    # event type names are kept (charset- and length-filtered); anything else shaped is "unrecognised"
    args = json.dumps({"path": SECRET})
    msgs = [created(), added("fc_1"), delta("fc_1", args), done("fc_1"), added("fc_2"), delta("fc_2", args),
            ev(f'response.x "{SECRET}"', x=1), (f"{{{SECRET}}}", "{" + SECRET)]
    out = feed(messages_records(msgs, R))
    assert any(isinstance(o, TerminalItem) for o in out)
    for o in out:
        if isinstance(o, (DeadLetter, AuditRecord)):
            assert SECRET not in repr(o)


def test_keep_mode_hands_over_the_quarantined_buffer_separately() -> None:
    out = feed(messages_records([created(), added("fc_1"), delta("fc_1", '{"pa')], R), keep_raw=True)
    kept = [o for o in out if isinstance(o, RetainedBuffer)]
    dead = [o for o in out if isinstance(o, DeadLetter)]
    assert [k.arguments for k in kept] == [b'{"pa'] and kept[0].call_id == dead[0].call_id
    assert not any(isinstance(o, RetainedBuffer) for o in feed(messages_records([created(), added("fc_1")], R)))


def test_normalizer_routes_runs_and_tracks_the_oldest_open_offset() -> None:
    norm = Normalizer()
    a = messages_records([created(), added("fc_1")], R, run_id="run-a", end=None)
    b = messages_records([created(), added("fc_1"), delta("fc_1", ARGS), done("fc_1")], R, run_id="run-b")
    offset = 0
    for record in [a[0], b[0], a[1], b[1], b[2], b[3], b[4], a[2], b[5]]:
        norm.feed(record, offset)
        offset += 1
    assert set(norm.runs) == {"run-a"} and norm.replay_from(99) == 0
    assert Normalizer().replay_from(7) == 7


# ---------------------------------------------------------------- properties

_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)
RENDERERS = [make_fixtures.Responses, make_fixtures.Anthropic, make_fixtures.Chat]
A = '{"path": "src/alpha.py", "max_bytes": 10}'
B = '{"path": "docs/beta.md"}'


@st.composite
def two_call_streams(draw):
    def pieces(text):
        cuts = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=4)))
        bounds = [0, *cuts, len(text)]
        return [text[i:j] for i, j in zip(bounds, bounds[1:])]

    a, b = pieces(A), pieces(B)
    # a random merge of the two delta sequences, each keeping its own order
    order = draw(st.permutations(["a"] * len(a) + ["b"] * len(b)))
    ops = [("open", "c1", "read_file"), ("open", "c2", "read_file")]
    ia = ib = 0
    for who in order:
        if who == "a":
            ops.append(("args", "c1", a[ia]))
            ia += 1
        else:
            ops.append(("args", "c2", b[ib]))
            ib += 1
        if draw(st.booleans()):
            ops.append(("text", "t"))
    ops += [("done", "c2"), ("done", "c1")] if draw(st.booleans()) else [("done", "c1"), ("done", "c2")]
    ops.append(("end",))
    renderer = draw(st.sampled_from(RENDERERS))
    wire = make_fixtures.render(renderer, "prop", ops).encode()
    cut = draw(st.one_of(st.none(), st.integers(0, len(wire))))
    chunk = draw(st.integers(0, 64))
    return renderer.route, wire if cut is None else wire[:cut], chunk


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_call_streams())
def test_parallel_calls_never_mix_and_every_opened_item_gets_one_decision(stream) -> None:
    route, wire, chunk = stream
    issued: list[str] = []

    def ids() -> str:
        issued.append(f"cg_{len(issued)}")
        return issued[-1]

    acc = RunAccumulator("run-p", call_ids=ids)
    out = []
    for record in attempt_records(wire, run_id="run-p", attempt_id="a1", attempt_number=1, route=route,
                                  tool_set=TOOLS, policy_id="demo", start_ms=0, chunk_size=chunk):
        out += acc.feed(record)
    terminals, dead, _ = split(out)
    decided = Counter([t.call_id for t in terminals] + [d.call_id for d in dead])
    assert decided == Counter(issued)  # exactly one decision per opened item, none for anything else
    by_provider = {t.provider_call_id: t.arguments for t in terminals}
    for provider_id, args in by_provider.items():
        assert args == {"call_c1": A, "toolu_c1": A, "call_c2": B, "toolu_c2": B}[provider_id].encode()
    assert not acc.open
