"""Avro single-object encoding of every record type."""

from __future__ import annotations

import dataclasses
import io
import json
import typing

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from callgate import avro
from callgate.errors import Reason, RecordError
from callgate.kafka import make_producer, read_topic
from callgate.records import AuditRecord, RawSseMessage, RunRequest

ALL_TYPES = avro.RECORD_TYPES


def test_every_dataclass_matches_its_schema_file():
    schemas = avro.load_schemas()
    assert set(schemas) == {t.__name__ for t in ALL_TYPES}
    for record_type in ALL_TYPES:
        fields = {f["name"]: f for f in schemas[record_type.__name__]["fields"]}
        hints = typing.get_type_hints(record_type)
        assert list(fields) == [f.name for f in dataclasses.fields(record_type)], record_type
        for name, hint in hints.items():
            nullable = type(None) in typing.get_args(hint)
            schema_nullable = isinstance(fields[name]["type"], list) and "null" in fields[name]["type"]
            assert nullable == schema_nullable, (record_type.__name__, name)


ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _strategy(hint: object) -> st.SearchStrategy:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _strategy(inner)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _strategy(args[1]), max_size=4)
    return {str: st.text(max_size=30), int: ints, bool: st.booleans(), bytes: st.binary(max_size=64)}[hint]


def _records() -> st.SearchStrategy:
    options = []
    for record_type in ALL_TYPES:
        hints = typing.get_type_hints(record_type)
        options.append(st.builds(record_type, **{n: _strategy(h) for n, h in hints.items()}))
    return st.one_of(options)


@settings(max_examples=300, deadline=None)
@given(_records())
def test_round_trip_of_any_record(record):
    data = avro.encode(record)
    assert data[:2] == b"\xc3\x01"
    assert avro.decode(data) == record


def test_an_audit_consumer_decodes_from_the_schema_files_alone():
    record = AuditRecord(
        observed_at=1, stage="validator", run_id="r", attempt_id="a", response_id="p", item_id="i",
        call_id="c", model_route="openai-responses", stream_event="response.output_item.done",
        tool_name="write_file", buffer_bytes=284, terminal_seen=True, json_status="valid",
        trailing_data=False, schema_status="valid", policy_status="approved", execution_state=None,
        state="POLICY_APPROVED",
    )
    data = avro.encode(record)
    # what an external consumer does: fingerprint every .avsc file, pick by header, read the body
    by_fingerprint = {}
    for path in avro.SCHEMA_DIR.glob("*.avsc"):
        schema = json.loads(path.read_text())
        by_fingerprint[avro.schema_fingerprint(schema)] = fastavro.parse_schema(schema)
    body = fastavro.schemaless_reader(io.BytesIO(data[10:]), by_fingerprint[data[2:10]])
    assert body["buffer_bytes"] == 284 and body["state"] == "POLICY_APPROVED"


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", Reason.RECORD_UNDECODABLE),
        (b"{\"json\": true}", Reason.RECORD_UNDECODABLE),
        (b"\xc3\x01" + b"\x00" * 8 + b"body", Reason.UNKNOWN_SCHEMA),
    ],
)
def test_bad_bytes_are_a_record_error_naming_where(data, reason):
    with pytest.raises(RecordError) as caught:
        avro.decode(data, topic="callgate.items", partition=2, offset=41)
    assert caught.value.reason is reason
    assert "callgate.items[2]@41" in str(caught.value)


def test_truncated_and_padded_bodies_are_record_errors():
    secret = "do-not-echo-this-secret"
    data = avro.encode(RunRequest("run", "route", "m", "http://x", secret.encode(), ["t"], "p", 1))
    for broken in (data[:-3], data + b"\x00\x01", data[:12]):
        with pytest.raises(RecordError) as caught:
            avro.decode(broken, topic="callgate.runs", partition=0, offset=7)
        assert caught.value.reason is Reason.RECORD_UNDECODABLE
        assert secret not in str(caught.value)


@pytest.mark.kafka
async def test_a_poison_record_is_reported_with_its_offset_and_skipped(kafka_bootstrap, topics):
    good = RawSseMessage("run-1", "a1", 0, "openai-responses", "openai-responses/1", 5, "message", "{}")
    producer = await make_producer(kafka_bootstrap)
    try:
        await producer.send_and_wait(topics.sse_raw, avro.encode(good), key=b"run-1")
        poison = await producer.send_and_wait(topics.sse_raw, b"\xc3\x01garbage", key=b"run-1")
        await producer.send_and_wait(topics.sse_raw, avro.encode(good), key=b"run-1")
    finally:
        await producer.stop()
    raw = await read_topic(kafka_bootstrap, topics.sse_raw, until=lambda r: len(r) >= 3, timeout_s=20)
    decoded, errors = [], []
    for message in raw:
        try:
            decoded.append(avro.decode(message.value, topic=message.topic, partition=message.partition,
                                       offset=message.offset))
        except RecordError as exc:
            errors.append(exc)
    assert decoded == [good, good]
    assert [(e.topic, e.partition, e.offset) for e in errors] == [(topics.sse_raw, poison.partition, poison.offset)]
