"""Catalogue 2.1 (J1-J14) and the parse-stage reasons, through the strict parser."""

from __future__ import annotations

import json

import pytest

from callgate.errors import ParseError, Reason
from validator.strict_json import FrozenDict, FrozenList, parse_arguments

DEEP = b"[" * 100_000 + b"]" * 100_000

BAD = [
    # J1: NaN / Infinity literals
    ("J1-nan", b'{"a": NaN}', Reason.NON_FINITE_NUMBER),
    ("J1-inf", b'{"a": Infinity}', Reason.NON_FINITE_NUMBER),
    ("J1-neg-inf", b'{"a": -Infinity}', Reason.NON_FINITE_NUMBER),
    # J2: overflow to inf never calls parse_constant
    ("J2-1e400", b'{"a": 1e400}', Reason.NON_FINITE_NUMBER),
    ("J2-neg-1e400", b'{"a": -1e400}', Reason.NON_FINITE_NUMBER),
    # J3: duplicate keys, top level and nested
    ("J3-dup", b'{"path":"ok.txt","path":"/etc/passwd"}', Reason.DUPLICATE_KEY),
    ("J3-dup-nested", b'{"a":{"x":1,"x":2}}', Reason.DUPLICATE_KEY),
    # J4 / J4b: huge and out-of-int64 integers
    ("J4-4301-digits", b'{"a": ' + b"9" * 4301 + b"}", Reason.INTEGER_OUT_OF_RANGE),
    ("J4b-25-digits", b'{"a": 1111111111111111111111111}', Reason.INTEGER_OUT_OF_RANGE),
    ("J4b-int64-max+1", b'{"a": 9223372036854775808}', Reason.INTEGER_OUT_OF_RANGE),
    ("J4b-int64-min-1", b'{"a": -9223372036854775809}', Reason.INTEGER_OUT_OF_RANGE),
    # J5: nesting (no RecursionError, no raised recursion limit)
    ("J5-deep-arrays", DEEP, Reason.NESTING_TOO_DEEP),
    ("J5-deep-objects", b'{"a":' * 65 + b"1" + b"}" * 65, Reason.NESTING_TOO_DEEP),
    # J6: lone surrogates in values and keys, reversed pair
    ("J6-lone-high", b'{"a": "\\ud800"}', Reason.LONE_SURROGATE),
    ("J6-lone-key", b'{"\\udc80": 1}', Reason.LONE_SURROGATE),
    ("J6-reversed-pair", b'{"a": "\\ude00\\ud83d"}', Reason.LONE_SURROGATE),
    ("J6-in-array", b'{"a": ["ok", "\\udfff"]}', Reason.LONE_SURROGATE),
    # J7: BOM and other encodings (never auto-detected)
    ("J7-utf8-bom", b'\xef\xbb\xbf{"a":1}', Reason.BOM_PRESENT),
    ("J7-utf16-bom", '{"a":1}'.encode("utf-16"), Reason.NOT_UTF8),
    ("J7-utf32", '{"a":1}'.encode("utf-32"), Reason.NOT_UTF8),
    # J8: one value then more
    ("J8-two-objects", b'{"a":1} {"b":2}', Reason.TRAILING_DATA),
    ("J8-trailing-junk", b'{"a":1}x', Reason.TRAILING_DATA),
    ("J8-trailing-brace", b'{"a":1}}', Reason.TRAILING_DATA),
    # J9: not UTF-8
    ("J9-ff", b'{"a":"\xff"}', Reason.NOT_UTF8),
    ("J9-overlong-slash", b'{"a":"\xc0\xaf"}', Reason.NOT_UTF8),
    ("J9-cesu-surrogate", b'{"a":"\xed\xa0\x80"}', Reason.NOT_UTF8),
    ("J9-truncated-seq", b'{"a":"\xe2\x82"}', Reason.NOT_UTF8),
    # J10: raw control characters stay rejected (strict=True)
    ("J10-raw-control", b'{"a":"x\x01y"}', Reason.INVALID_JSON),
    ("J10-raw-newline", b'{"a":"x\ny"}', Reason.INVALID_JSON),
    # J12: top level must be an object
    ("J12-string", b'"x"', Reason.NOT_AN_OBJECT),
    ("J12-array", b"[1]", Reason.NOT_AN_OBJECT),
    ("J12-number", b"1", Reason.NOT_AN_OBJECT),
    ("J12-null", b"null", Reason.NOT_AN_OBJECT),
    # J14: lenient syntax is never repaired
    ("J14-nbsp", '{"a":1}\u00a0'.encode(), Reason.TRAILING_DATA),
    ("J14-nbsp-inside", '{\u00a0"a":1}'.encode(), Reason.INVALID_JSON),
    ("J14-leading-zero", b'{"a": 01}', Reason.INVALID_JSON),
    ("J14-single-quotes", b"{'a': 1}", Reason.INVALID_JSON),
    ("J14-comment", b'{"a": 1 /* c */}', Reason.INVALID_JSON),
    ("J14-trailing-comma", b'{"a": 1,}', Reason.INVALID_JSON),
    ("J14-unterminated", b'{"path": "a', Reason.INVALID_JSON),
    ("J14-truncated", b'{"path": "a",', Reason.INVALID_JSON),
    # empty and oversize buffers
    ("empty", b"", Reason.EMPTY_BUFFER),
    ("whitespace-only", b" \n\t\r ", Reason.EMPTY_BUFFER),
    ("too-large", b'{"a":"' + b"x" * (1 << 20) + b'"}', Reason.BUFFER_TOO_LARGE),
]


@pytest.mark.parametrize(("case", "buffer", "reason"), BAD, ids=[c[0] for c in BAD])
def test_bad_buffer_has_its_reason(case: str, buffer: bytes, reason: Reason) -> None:
    with pytest.raises(ParseError) as info:
        parse_arguments(buffer)
    assert info.value.reason is reason
    # the message never carries the buffer, nor the exception chain a JSONDecodeError with .doc
    assert info.value.__cause__ is None and info.value.__context__ is None
    if len(buffer) > 12:
        assert buffer.decode("utf-8", "replace")[:12] not in str(info.value)


def test_secret_value_not_in_message() -> None:
    with pytest.raises(ParseError) as info:
        parse_arguments(b'{"token": "hunter2-secret", "token": "x"}')
    assert "hunter2" not in str(info.value) and "token" not in str(info.value)
    with pytest.raises(ParseError) as info:
        parse_arguments(b'{"token": "hunter2-secret"} trailing-hunter2')
    assert "hunter2" not in str(info.value)


GOOD = [
    (b'{"a":1}', {"a": 1}),
    (b'  \n{"a": 1}\r\n\t ', {"a": 1}),  # JSON whitespace around the value is fine
    (b'{"a": 9223372036854775807, "b": -9223372036854775808}', {"a": 2**63 - 1, "b": -(2**63)}),
    (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001f600"}),  # an escaped valid pair combines
    (b'{"a": "[[[[{{{{"}', {"a": "[[[[{{{{"}),  # brackets inside strings are not nesting
    (b'{"a": "x\\u0000y"}', {"a": "x\x00y"}),  # J11: the parser accepts it; policy refuses it
    (b'{"a":' * 63 + b"1" + b"}" * 63, None),  # depth 63 < 64
]


@pytest.mark.parametrize(("buffer", "expected"), GOOD)
def test_good_buffers_parse(buffer: bytes, expected: object) -> None:
    parsed = parse_arguments(buffer)
    if expected is not None:
        assert parsed.value == expected
    assert parsed.byte_count == len(buffer)
    assert json.loads(parsed.canonical) == parsed.value


def test_depth_limit_is_exact() -> None:
    assert parse_arguments(b'{"a":' * 63 + b"[1]" + b"}" * 63)  # 64 levels
    with pytest.raises(ParseError) as info:
        parse_arguments(b'{"a":' * 64 + b"[1]" + b"}" * 64)  # 65 levels
    assert info.value.reason is Reason.NESTING_TOO_DEEP


def test_escaped_quotes_do_not_fool_the_depth_scan() -> None:
    buffer = b'{"a": "\\"[[[[[[[[[[[[[[[[[[[[\\"", "b": ' + b"[" * 70 + b"]" * 70 + b"}"
    with pytest.raises(ParseError) as info:
        parse_arguments(buffer)
    assert info.value.reason is Reason.NESTING_TOO_DEEP


def test_canonical_form_is_sorted_compact_and_immutable() -> None:
    parsed = parse_arguments(b'{"b": [1, {"d": 2, "c": 3}], "a": "\xc3\xa9"}')
    assert parsed.canonical == '{"a":"é","b":[1,{"c":3,"d":2}]}'.encode()
    assert isinstance(parsed.value, FrozenDict) and isinstance(parsed.value["b"], FrozenList)
    with pytest.raises(TypeError):
        parsed.value["a"] = "x"
    with pytest.raises(TypeError):
        parsed.value["b"].append(1)
    with pytest.raises(TypeError):
        parsed.value["b"][1]["c"] = 4


def test_quadratic_escape_input_is_fast() -> None:
    import time

    buffer = b'{"a": "' + b'\\"' * 400_000 + b"x"  # unterminated, many escaped quotes
    started = time.monotonic()
    with pytest.raises(ParseError):
        parse_arguments(buffer)
    assert time.monotonic() - started < 2.0
