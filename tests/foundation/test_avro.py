"""Avro single-object encoding of every record type, and what bad bytes do."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import typing
import uuid
from datetime import datetime, timezone

import fastavro
import fastavro.schema
import pytest
from aiokafka import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from callgate import avro, records
from callgate.errors import Reason, RecordError
from callgate.kafka import make_consumer, make_producer
from callgate.records import AttemptStarted, AuditRecord, RawSseMessage, RunRequest, TransportEnd

ALL_TYPES = avro.RECORD_TYPES
SECRET = "do-not-echo-this-secret"

AVRO_TYPE_OF = {str: "string", int: "long", bool: "boolean", bytes: "bytes"}


def _avro_type(hint: object) -> object:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return ["null", _avro_type(inner)]
    if origin is list:
        return {"type": "array", "items": _avro_type(args[0])}
    if origin is dict:
        assert args[0] is str, "Avro map keys are strings"
        return {"type": "map", "values": _avro_type(args[1])}
    return AVRO_TYPE_OF[hint]


def _without_logical_type(t: object) -> object:
    if isinstance(t, dict) and "logicalType" in t:
        return t["type"]
    return t


def test_every_dataclass_has_exactly_one_schema_file():
    schemas = avro.load_schemas()
    dataclass_names = {
        name for name, obj in vars(records).items() if isinstance(obj, type) and dataclasses.is_dataclass(obj)
    }
    assert {t.__name__ for t in ALL_TYPES} == dataclass_names
    assert set(schemas) == dataclass_names
    assert len(list(avro.SCHEMA_DIR.glob("*.avsc"))) == len(dataclass_names)


@pytest.mark.parametrize("record_type", ALL_TYPES, ids=lambda t: t.__name__)
def test_dataclass_and_schema_never_drift(record_type):
    schema = avro.load_schemas()[record_type.__name__]
    assert schema["type"] == "record" and schema["namespace"] == "callgate.v1"
    assert schema.get("doc"), "every record schema says what it is"
    fields = {f["name"]: f for f in schema["fields"]}
    assert list(fields) == [f.name for f in dataclasses.fields(record_type)]
    hints = typing.get_type_hints(record_type)
    for dc_field in dataclasses.fields(record_type):
        name, avro_field = dc_field.name, fields[dc_field.name]
        where = f"{record_type.__name__}.{name}"
        # times are timestamp-millis in the file, ints in the record: a field is a time iff it ends in _at
        is_time = isinstance(avro_field["type"], dict) and avro_field["type"].get("logicalType") == "timestamp-millis"
        assert is_time == name.endswith("_at"), where
        assert _without_logical_type(avro_field["type"]) == _avro_type(hints[name]), where
        nullable = type(None) in typing.get_args(hints[name])
        if nullable:
            assert "default" in avro_field and avro_field["default"] is None, f"{where}: nullable needs default null"
        if dc_field.default is not dataclasses.MISSING:
            assert avro_field.get("default", "missing") == dc_field.default, where
        elif dc_field.default_factory is not dataclasses.MISSING:
            assert avro_field.get("default", "missing") == dc_field.default_factory(), where
        elif not nullable:
            assert "default" not in avro_field, f"{where}: required in the dataclass, so no default in the schema"


def _spec_fingerprint64(canonical: str) -> int:
    """CRC-64-AVRO (Rabin) as the Avro specification defines it, written out independently of fastavro."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in canonical.encode("utf-8"):
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_headers_are_marker_and_little_endian_rabin_fingerprint_of_the_canonical_form():
    assert _spec_fingerprint64('"null"') == 7195948357588979594  # the specification's own test vector
    schemas = avro.load_schemas()
    for record_type in ALL_TYPES:
        canonical = fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(schemas[record_type.__name__]))
        assert canonical.startswith('{"name":"callgate.v1.')
        expected = b"\xc3\x01" + struct.pack("<Q", _spec_fingerprint64(canonical))
        sample = _example(record_type)
        assert avro.encode(sample)[:10] == expected, record_type.__name__


ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _strategy(hint: object) -> st.SearchStrategy:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _strategy(inner)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _strategy(args[1]), max_size=4)
    return {str: st.text(max_size=30), int: ints, bool: st.booleans(), bytes: st.binary(max_size=64)}[hint]


def _record_strategy(record_type: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(record_type)
    return st.builds(record_type, **{f.name: _strategy(hints[f.name]) for f in dataclasses.fields(record_type)})


def _example_value(hint: object) -> object:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        return None
    if origin is list:
        return [_example_value(args[0])]
    if origin is dict:
        return {"k": _example_value(args[1])}
    return {str: "x", int: 7, bool: True, bytes: b"{}"}[hint]


def _example(record_type: type):
    hints = typing.get_type_hints(record_type)
    return record_type(**{f.name: _example_value(hints[f.name]) for f in dataclasses.fields(record_type)})


@settings(max_examples=400, deadline=None)
@given(st.one_of([_record_strategy(t) for t in ALL_TYPES]))
def test_round_trip_of_any_record(record):
    data = avro.encode(record)
    assert data[:2] == b"\xc3\x01"
    assert avro.decode(data) == record
    assert avro.decode(memoryview(data)) == record and avro.decode(bytearray(data)) == record
    name, body = avro.decode_dict(data)
    assert name == type(record).__name__ and body == dataclasses.asdict(record)


def test_one_topic_carries_several_record_types():
    attempt = [
        AttemptStarted("r", "a", 1, "openai-responses", "v1", "m", ["read_file"], "p", 10),
        RawSseMessage("r", "a", 1, "openai-responses", "v1", 11, "message", "{}"),
        TransportEnd("r", "a", 2, "openai-responses", "transport_eof", 12, 40, 1),
    ]
    assert [avro.decode(avro.encode(r)) for r in attempt] == attempt
    assert len({avro.encode(r)[:10] for r in attempt}) == 3


def test_an_audit_consumer_decodes_from_the_schema_files_alone():
    record = AuditRecord(
        observed_at=1_764_680_000_123, stage="validator", run_id="r", attempt_id="a", response_id="p",
        item_id="i", call_id="c", model_route="openai-responses", stream_event="response.output_item.done",
        tool_name="write_file", buffer_bytes=284, terminal_seen=True, json_status="valid",
        trailing_data=False, schema_status="valid", policy_status="approved", execution_state=None,
        state="POLICY_APPROVED", extra={"unknown_events": "2"},
    )
    data = avro.encode(record)
    # what an external consumer does with plain fastavro: fingerprint every .avsc file, pick by header
    by_fingerprint = {}
    for path in avro.SCHEMA_DIR.glob("*.avsc"):
        parsed = fastavro.parse_schema(json.loads(path.read_text()))
        canonical = fastavro.schema.to_parsing_canonical_form(parsed)
        by_fingerprint[bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))] = parsed
    assert data[:2] == b"\xc3\x01"
    schema = by_fingerprint[data[2:10]]
    body = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema)
    assert schema["name"] == "callgate.v1.AuditRecord"
    assert body["buffer_bytes"] == 284 and body["state"] == "POLICY_APPROVED" and body["execution_state"] is None
    assert body["extra"] == {"unknown_events": "2"}
    # the logical type gives an outside reader a real time
    assert body["observed_at"] == datetime(2025, 12, 2, 12, 53, 20, 123000, tzinfo=timezone.utc)


def _varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)  # zigzag
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | 0x80 if n else low)
        if not n:
            return bytes(out)


def _avro_string(raw: bytes) -> bytes:
    return _varint(len(raw)) + raw


GOOD = avro.encode(RunRequest("run", "route", "m", "http://x", SECRET.encode(), ["t"], "p", 1))
HEADER = GOOD[:10]
RUN_PREFIX = b"".join(_avro_string(s) for s in (b"run", b"route", b"m", b"http://x"))

BAD_BYTES = {
    "tombstone": (None, Reason.RECORD_UNDECODABLE),
    "empty": (b"", Reason.RECORD_UNDECODABLE),
    "short header": (GOOD[:9], Reason.RECORD_UNDECODABLE),
    "json": (b'{"json": true, "secret": "' + SECRET.encode() + b'"}', Reason.RECORD_UNDECODABLE),
    "bad marker": (b"\xc3\x02" + GOOD[2:], Reason.RECORD_UNDECODABLE),
    "legacy confluent framing": (b"\x00\x00\x00\x00\x07" + GOOD[10:], Reason.RECORD_UNDECODABLE),
    "unknown fingerprint": (b"\xc3\x01" + b"\x00" * 8 + GOOD[10:], Reason.UNKNOWN_SCHEMA),
    "header only": (HEADER, Reason.RECORD_UNDECODABLE),
    "truncated body": (GOOD[:-3], Reason.RECORD_UNDECODABLE),
    "truncated inside arguments": (GOOD[: len(GOOD) // 2], Reason.RECORD_UNDECODABLE),
    "trailing bytes": (GOOD + b"\x00\x01", Reason.RECORD_UNDECODABLE),
    "invalid utf-8 in a string": (HEADER + _avro_string(b"\xff\xfe" + SECRET.encode()) + GOOD[14:],
                                  Reason.RECORD_UNDECODABLE),
    "negative length": (HEADER + _varint(-7) + SECRET.encode(), Reason.RECORD_UNDECODABLE),
    "huge length": (HEADER + _varint(2**62) + SECRET.encode(), Reason.RECORD_UNDECODABLE),
    "huge array count": (HEADER + RUN_PREFIX + _avro_string(b"{}") + _varint(2**40), Reason.RECORD_UNDECODABLE),
    "union branch out of range": (HEADER + GOOD[10:-1] + _varint(5), Reason.RECORD_UNDECODABLE),
}


@pytest.mark.parametrize("data, reason", BAD_BYTES.values(), ids=BAD_BYTES.keys())
def test_every_class_of_bad_bytes_is_a_record_error_naming_where(data, reason):
    for read in (avro.decode, avro.decode_dict):
        with pytest.raises(RecordError) as caught:
            read(data, topic="callgate.runs", partition=2, offset=41)
        error = caught.value
        assert error.reason is reason
        assert (error.topic, error.partition, error.offset) == ("callgate.runs", 2, 41)
        assert str(error).startswith(f"{reason.value}: callgate.runs[2]@41")
        assert SECRET not in str(error) and "\\x" not in str(error)
        # no fastavro exception chained in, whose message or locals might show the bytes
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_the_last_field_of_a_valid_record_decodes():
    # the union case above only breaks because of the branch index, not because the prefix is wrong
    assert avro.decode(GOOD[:-1] + _varint(0)) == RunRequest("run", "route", "m", "http://x", SECRET.encode(),
                                                             ["t"], "p", 1)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(ALL_TYPES).flatmap(lambda t: st.tuples(st.just(t), _record_strategy(t))),
    st.lists(st.tuples(st.integers(min_value=10), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(min_value=10),
)
def test_mutated_records_decode_or_raise_record_error_only(typed_record, flips, cut):
    record_type, record = typed_record
    data = bytearray(avro.encode(record))
    for position, value in flips:
        data[position % len(data) if len(data) > 10 else 0] = value
    for candidate in (bytes(data), bytes(data[: max(10, cut % (len(data) + 1))])):
        try:
            decoded = avro.decode(candidate, topic="t", partition=0, offset=1)
        except RecordError as exc:
            assert exc.reason in (Reason.RECORD_UNDECODABLE, Reason.UNKNOWN_SCHEMA)
        else:
            assert type(decoded) in ALL_TYPES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_after_a_known_header_never_escape_as_another_exception(body):
    for header in {avro.encode(_example(t))[:10] for t in (RunRequest, AuditRecord, TransportEnd)}:
        try:
            avro.decode(header + body)
        except RecordError:
            pass


def test_encode_refuses_what_is_not_a_record():
    with pytest.raises(TypeError):
        avro.encode({"run_id": "r"})


@pytest.mark.kafka
async def test_a_poison_record_is_reported_with_its_offset_and_committed_past(kafka_bootstrap, topics):
    records_in = [
        AttemptStarted("run-1", "a1", 1, "openai-responses", "openai-responses/1", "m", ["read_file"], "p", 4),
        RawSseMessage("run-1", "a1", 1, "openai-responses", "openai-responses/1", 5, "message", "{}"),
        TransportEnd("run-1", "a1", 2, "openai-responses", "transport_eof", 6, 10, 1),
    ]
    values = [
        avro.encode(records_in[0]),
        # a body cut short inside a secret-bearing field
        avro.encode(RawSseMessage("run-1", "a1", 9, "openai-responses", "v", 5, "message", SECRET))[:-8],
        avro.encode(records_in[1]),
        b"\xc3\x01" + b"\xee" * 8 + b"from a newer schema",
        avro.encode(records_in[2]),
    ]
    producer = await make_producer(kafka_bootstrap)
    try:
        sent = [await producer.send_and_wait(topics.sse_raw, v, key=b"run-1", partition=0) for v in values]
    finally:
        await producer.stop()
    tp = TopicPartition(topics.sse_raw, 0)
    group = f"codec-test-{uuid.uuid4().hex[:8]}"

    # what a worker does: decode, and on RecordError park the record and commit past it
    consumer = await make_consumer(kafka_bootstrap, topics.sse_raw, group_id=group)
    decoded, errors = [], []
    try:
        while len(decoded) + len(errors) < len(values):
            batch = await consumer.getmany(timeout_ms=500)
            for message in batch.get(tp, []):
                try:
                    decoded.append(avro.decode(message.value, topic=message.topic, partition=message.partition,
                                               offset=message.offset))
                except RecordError as exc:
                    errors.append(exc)
                await consumer.commit({tp: message.offset + 1})
    finally:
        await consumer.stop()
    assert decoded == records_in
    assert [(e.reason, e.topic, e.partition, e.offset) for e in errors] == [
        (Reason.RECORD_UNDECODABLE, topics.sse_raw, 0, sent[1].offset),
        (Reason.UNKNOWN_SCHEMA, topics.sse_raw, 0, sent[3].offset),
    ]
    assert all(SECRET not in str(e) for e in errors)

    # a restarted member of the group resumes after the poison instead of re-reading it
    again = await make_consumer(kafka_bootstrap, topics.sse_raw, group_id=group)
    try:
        assert await again.committed(tp) == sent[-1].offset + 1
    finally:
        await again.stop()
