from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from callgate.errors import Reason, SseError
from ingest.decoder import EndOfStream, SseDecoder, SseLimitExceeded, SseMessage
from tests.ingest.sse_reference import reference_decode

REPO = Path(__file__).resolve().parents[2]
FIXTURE_ROOTS = [REPO / "fixtures", Path("/work/shared/fixtures-real")]


def decode_all(chunks: list[bytes], **kw: int) -> tuple[list[SseMessage], EndOfStream]:
    decoder = SseDecoder(**kw)
    messages: list[SseMessage] = []
    for chunk in chunks:
        messages.extend(decoder.feed(chunk))
    return messages, decoder.close()


def decode(stream: bytes) -> list[SseMessage]:
    return decode_all([stream])[0]


def m(data: str, event: str = "message", last_event_id: str = "", retry: int | None = None) -> SseMessage:
    return SseMessage(event=event, data=data, last_event_id=last_event_id, retry=retry)


# -- conformance vectors, one per rule -------------------------------------------------

VECTORS: list[tuple[str, bytes, list[SseMessage]]] = [
    ("simple", b"data: hello\n\n", [m("hello")]),
    ("no_space_after_colon", b"data:hello\n\n", [m("hello")]),
    ("only_one_space_stripped", b"data:  two\n\n", [m(" two")]),
    ("tab_not_stripped", b"data:\tx\n\n", [m("\tx")]),
    ("multi_line_data_joined_with_lf", b"data: a\ndata: b\ndata:\n\n", [m("a\nb\n")]),
    ("empty_data_line_dispatches_empty_string", b"data\n\n", [m("")]),
    ("field_without_colon_is_name", b"data\ndata\n\n", [m("\n")]),
    ("named_event", b"event: add\ndata: 1\n\n", [m("1", event="add")]),
    ("empty_event_is_message", b"event:\ndata: 1\n\n", [m("1")]),
    ("event_type_resets_per_message", b"event: a\ndata: 1\n\ndata: 2\n\n", [m("1", "a"), m("2")]),
    ("event_without_data_not_dispatched", b"event: a\n\ndata: 2\n\n", [m("2")]),
    ("no_dispatch_without_blank_line", b"data: 1\n", []),
    ("crlf", b"data: a\r\ndata: b\r\n\r\n", [m("a\nb")]),
    ("cr_only", b"data: a\rdata: b\r\r", [m("a\nb")]),
    ("mixed_line_ends", b"data: a\r\n\ndata: b\r\rdata: c\n\r\n", [m("a"), m("b"), m("c")]),
    ("lf_cr_is_two_line_ends", b"data: a\n\rdata: b\n\n", [m("a"), m("b")]),
    ("comment_ignored", b": keepalive\ndata: x\n: mid\n\n", [m("x")]),
    ("comment_only_block", b": hi\n\n", []),
    ("colon_in_value_kept", b'data: {"a": "b:c"}\n\n', [m('{"a": "b:c"}')]),
    ("unknown_field_ignored", b"foo: bar\ndata: x\n\n", [m("x")]),
    ("field_names_case_sensitive", b"Data: x\nDATA: y\ndata: z\n\n", [m("z")]),
    ("id_sets_last_event_id", b"id: 7\ndata: x\n\n", [m("x", last_event_id="7")]),
    ("id_persists", b"id: 7\ndata: x\n\ndata: y\n\n", [m("x", last_event_id="7"), m("y", last_event_id="7")]),
    ("id_with_nul_ignored", b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n",
     [m("a", last_event_id="1"), m("b", last_event_id="1")]),
    ("empty_id_resets", b"id: 1\ndata: a\n\nid\ndata: b\n\n", [m("a", last_event_id="1"), m("b")]),
    ("id_on_undispatched_block_still_persists", b"id: 9\n\ndata: a\n\n", [m("a", last_event_id="9")]),
    ("retry_digits", b"retry: 1500\ndata: a\n\n", [m("a", retry=1500)]),
    ("retry_non_digits_ignored", b"retry: 15a\ndata: a\n\nretry: -1\ndata: b\n\nretry:\ndata: c\n\n",
     [m("a"), m("b"), m("c")]),
    ("retry_not_unicode_digits", "retry: \u0661\u0662\ndata: a\n\n".encode(), [m("a")]),
    ("retry_per_message", b"retry: 10\ndata: a\n\ndata: b\n\n", [m("a", retry=10), m("b")]),
    ("bom_stripped", b"\xef\xbb\xbfdata: a\n\n", [m("a")]),
    ("only_one_bom_stripped", b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n", [m("b")]),
    ("bom_not_stripped_later", b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [m("a")]),
    ("invalid_utf8_replaced", b"data: a\xffb\n\n", [m("a\ufffdb")]),
    ("truncated_multibyte_replaced", b"data: \xe2\x82\n\n", [m("\ufffd")]),
    ("utf8_multibyte", "data: h\u00e9llo \u20ac \U0001f600\n\n".encode(), [m("h\u00e9llo \u20ac \U0001f600")]),
    ("leading_blank_lines", b"\n\n\ndata: a\n\n", [m("a")]),
    ("space_before_colon_is_part_of_name", b"data : x\n\n", []),
    ("done_marker_is_data", b"data: [DONE]\n\n", [m("[DONE]")]),
]


@pytest.mark.parametrize("name,stream,expected", VECTORS, ids=[v[0] for v in VECTORS])
def test_vector(name: str, stream: bytes, expected: list[SseMessage]) -> None:
    assert decode(stream) == expected
    # the naive reference must agree, otherwise the vector or the reference is wrong
    assert reference_decode(stream)[0] == expected
    # and so must byte-at-a-time feeding
    assert decode_all([bytes([b]) for b in stream])[0] == expected


def test_comments_counted() -> None:
    decoder = SseDecoder()
    decoder.feed(b": a\n:b\ndata: x\n\n: c\n")
    assert decoder.comments >= 2  # exact at dispatch and at close
    assert decoder.close().comments == 3


def test_unterminated_message_reported_and_not_dispatched() -> None:
    messages, end = decode_all([b"data: a\n\ndata: b\n"])
    assert messages == [m("a")]
    assert end.incomplete
    assert end.pending_bytes == len(b"data: b\n")
    assert end.messages == 1


def test_partial_line_at_eof_is_incomplete() -> None:
    messages, end = decode_all([b"data: a\n\ndata: b"])
    assert messages == [m("a")]
    assert end.incomplete and end.pending_bytes == len(b"data: b")


def test_clean_end_is_complete() -> None:
    _, end = decode_all([b"data: a\n\n: trailing comment\n"])
    assert not end.incomplete and end.error is None
    _, end = decode_all([b"data: a\r\n\r\n"])
    assert not end.incomplete


def test_trailing_cr_is_a_line_end_at_eof() -> None:
    messages, end = decode_all([b"data: a\r\r"])
    assert messages == [m("a")] and not end.incomplete


def test_cr_at_chunk_end_then_lf_is_one_line_end() -> None:
    # if the CR and LF were two line ends, the blank line would dispatch "a" early
    messages, _ = decode_all([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"])
    assert messages == [m("a\nb")]


def test_bom_split_across_chunks() -> None:
    messages, _ = decode_all([b"\xef", b"\xbb", b"\xbfdata: a\n\n"])
    assert messages == [m("a")]


def test_bom_prefix_that_is_not_a_bom() -> None:
    messages, end = decode_all([b"\xef", b"\xbbdata: a\n\ndata: b\n\n"])
    assert messages == [m("b")]  # the first line's name is "\ufffddata", an unknown field
    assert not end.incomplete


def test_short_stream_that_looks_like_bom_start_is_incomplete() -> None:
    _, end = decode_all([b"\xef\xbb"])
    assert end.incomplete


def test_multibyte_split_across_chunks() -> None:
    raw = "data: \u20ac\U0001f600\n\n".encode()
    for cut in range(len(raw)):
        assert decode_all([raw[:cut], raw[cut:]])[0] == [m("\u20ac\U0001f600")]


def test_last_event_id_and_retry_on_close() -> None:
    _, end = decode_all([b"id: x\nretry: 30\n\n"])
    assert end.last_event_id == "x" and end.retry == 30 and end.messages == 0


def test_feed_after_close_is_an_error() -> None:
    decoder = SseDecoder()
    decoder.close()
    with pytest.raises(RuntimeError):
        decoder.feed(b"data: a\n\n")


# -- limits -----------------------------------------------------------------------------


def test_line_too_long_keeps_earlier_messages_and_fails_the_decoder() -> None:
    decoder = SseDecoder(max_line_bytes=32)
    with pytest.raises(SseLimitExceeded) as info:
        decoder.feed(b"data: ok\n\ndata: " + b"x" * 40 + b"\n\ndata: after\n\n")
    assert info.value.reason is Reason.SSE_LINE_TOO_LONG
    assert isinstance(info.value, SseError)
    assert info.value.dispatched == [m("ok")]
    assert "x" * 10 not in str(info.value)  # content never reaches the message
    with pytest.raises(SseLimitExceeded) as again:
        decoder.feed(b"data: more\n\n")
    assert again.value.reason is Reason.SSE_LINE_TOO_LONG and again.value.dispatched == []
    end = decoder.close()
    assert end.error is Reason.SSE_LINE_TOO_LONG and end.messages == 1


def test_partial_line_too_long_detected_before_its_line_end() -> None:
    decoder = SseDecoder(max_line_bytes=64)
    decoder.feed(b"data: " + b"y" * 50)
    with pytest.raises(SseLimitExceeded) as info:
        decoder.feed(b"y" * 50)  # still no line end: memory must stay bounded anyway
    assert info.value.reason is Reason.SSE_LINE_TOO_LONG


def test_line_at_the_limit_is_fine() -> None:
    line = b"data: " + b"z" * 26  # 32 bytes
    assert decode_all([line + b"\n\n"], max_line_bytes=32)[0] == [m("z" * 26)]


def test_message_too_large_across_many_short_lines() -> None:
    decoder = SseDecoder(max_message_bytes=100)
    decoder.feed(b"data: first\n\n")
    with pytest.raises(SseLimitExceeded) as info:
        for _ in range(50):
            decoder.feed(b"data: 0123456789\n")
    assert info.value.reason is Reason.SSE_MESSAGE_TOO_LARGE
    assert decoder.failed is Reason.SSE_MESSAGE_TOO_LARGE
    assert decoder.close().error is Reason.SSE_MESSAGE_TOO_LARGE


def test_message_too_large_within_one_chunk_is_not_dispatched() -> None:
    decoder = SseDecoder(max_message_bytes=20)
    with pytest.raises(SseLimitExceeded) as info:
        decoder.feed(b"data: a\n\n" + b"data: 0123456789\n" * 3 + b"\n" + b"data: b\n\n")
    assert info.value.reason is Reason.SSE_MESSAGE_TOO_LARGE
    assert info.value.dispatched == [m("a")]


# -- chunking invariance ---------------------------------------------------------------

_alphabet = st.sampled_from(
    [b"data", b"event", b"id", b"retry", b":", b": ", b" ", b"\n", b"\r", b"\r\n", b"x", b"7",
     b"\x00", b"\xef\xbb\xbf", b"\xe2\x82\xac", b"\xe2", b"\xff", b"\xf0\x9f\x98\x80", b"{\"a\":1}",
     # whole well-formed messages, so that the bulk path is exercised and interleaved with the rest
     b"data: ", b"event: ", b"\n\n", b"\r\n\r\n", b"data: {\"a\":1}\n\n", b"event: e\ndata: v\n\n",
     b"event: e\r\ndata: v\r\n\r\n", b"data: \xe2\x82\xac\r\n\r\n", b"event:\ndata: w\n\n"]
)
streams = st.lists(_alphabet, max_size=60).map(b"".join)


@st.composite
def stream_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    stream = draw(streams)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    bounds = [0, *cuts, len(stream)]
    return stream, [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(stream_and_cuts())
def test_any_split_gives_the_same_messages_as_the_reference(case: tuple[bytes, list[bytes]]) -> None:
    stream, chunks = case
    expected, incomplete, comments = reference_decode(stream)
    whole, whole_end = decode_all([stream])
    split, split_end = decode_all(chunks)
    assert whole == expected
    assert split == expected
    assert whole_end.incomplete == split_end.incomplete == incomplete
    assert whole_end.comments == split_end.comments == comments


@settings(max_examples=300, deadline=None)
@given(stream_and_cuts(), st.integers(1, 24), st.integers(1, 48))
def test_small_limits_fail_cleanly_or_agree(
    case: tuple[bytes, list[bytes]], max_line: int, max_message: int
) -> None:
    stream, chunks = case
    expected = reference_decode(stream)[0]
    decoder = SseDecoder(max_line_bytes=max_line, max_message_bytes=max_message)
    got: list[SseMessage] = []
    try:
        for chunk in chunks:
            got.extend(decoder.feed(chunk))
    except SseLimitExceeded as exc:
        got.extend(exc.dispatched)
        assert exc.reason in (Reason.SSE_LINE_TOO_LONG, Reason.SSE_MESSAGE_TOO_LARGE)
        assert got == expected[: len(got)]  # what came out before the failure is right
        assert decoder.close().error is exc.reason
        return
    assert got == expected


def test_bulk_and_general_paths_interleave() -> None:
    # well-formed runs take the bulk path; a comment forces the general path for a while
    stream = (b"event: a\ndata: 1\n\n" * 5 + b": c\n\n" + b"data: 2\n\n" * 3) * 40
    for size in (7, 64, 4096):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert decode_all(chunks)[0] == reference_decode(stream)[0]


def fixture_files() -> list[Path]:
    found = sorted({p for root in FIXTURE_ROOTS if root.is_dir() for p in root.rglob("*.sse")})
    return found


@pytest.mark.parametrize("path", fixture_files(), ids=lambda p: p.name)
def test_every_byte_boundary_of_fixture(path: Path) -> None:
    raw = path.read_bytes()
    expected, end = decode_all([raw])
    assert expected == reference_decode(raw)[0]
    assert expected, "a shipped fixture should contain messages"
    for variant in (raw, raw.replace(b"\n", b"\r\n")):
        want = decode_all([variant])[0]
        assert want == expected
        for cut in range(1, len(variant)):
            got = decode_all([variant[:cut], variant[cut:]])[0]
            assert got == want, f"split at byte {cut} differs"
    # and one byte at a time
    assert decode_all([raw[i:i + 1] for i in range(len(raw))])[0] == expected


def test_fixtures_are_found() -> None:
    assert len(fixture_files()) >= 1
