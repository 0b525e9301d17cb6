"""Avro single-object encoding of callgate's records, with fastavro.

Wire format (Avro specification, "Single-object encoding"): the two bytes
C3 01, the schema's 8-byte CRC-64-AVRO fingerprint of its Parsing Canonical
Form (little-endian), then the schemaless binary body. The fingerprint picks
the schema, so one topic may carry several record types (sse.raw carries
AttemptStarted, RawSseMessage and TransportEnd) and an audit consumer needs
nothing but the files in `schemas/` to decode any record.

Every dataclass in `callgate.records` has one schema, found by its class name;
field names are the dataclass field names. Times are `long` with logical type
`timestamp-millis` in the files, so an outside reader gets datetimes; the
records themselves carry integer milliseconds, so this codec reads and writes
the plain `long` underneath (logical types are not part of the canonical form:
the fingerprint is the same either way).

Every decoding failure (short buffer, bad marker, unknown fingerprint, corrupt
body, trailing bytes, a missing value) raises `RecordError` with reason
`record_undecodable` or `unknown_schema`, naming topic, partition and offset,
with no record bytes in the message; nothing else escapes `decode`. A worker
treats it as a poison record: it parks it (a dead letter with reason
`record_undecodable`), commits past it and moves on, instead of crashing and
re-reading the same offset forever.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from callgate import records
from callgate.errors import Reason, RecordError

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8

# Every record dataclass, in definition order.
RECORD_TYPES: tuple[type, ...] = tuple(
    obj
    for obj in vars(records).values()
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == records.__name__
)


@dataclass(frozen=True, slots=True)
class _Codec:
    record_type: type
    schema: Any  # parsed by fastavro, logical types stripped
    header: bytes
    field_names: tuple[str, ...]


def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    """The 8 header bytes for a schema: CRC-64-AVRO of its canonical form, little-endian."""
    parsed = fastavro.parse_schema(schema)
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


def load_schemas(schema_dir: Path = SCHEMA_DIR) -> dict[str, dict[str, Any]]:
    """Every record schema by its short name, as written in the .avsc files."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(schema_dir.glob("*.avsc")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        out[schema["name"]] = schema
    return out


def _without_logical_types(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_without_logical_types(v) for v in node]
    return node


def _build() -> tuple[dict[type, _Codec], dict[bytes, _Codec]]:
    schemas = load_schemas()
    by_type: dict[type, _Codec] = {}
    by_fingerprint: dict[bytes, _Codec] = {}
    for record_type in RECORD_TYPES:
        raw = schemas.get(record_type.__name__)
        if raw is None:
            raise RuntimeError(f"no schema in {SCHEMA_DIR} for record type {record_type.__name__}")
        codec = _Codec(
            record_type=record_type,
            schema=fastavro.parse_schema(_without_logical_types(raw)),
            header=MARKER + schema_fingerprint(raw),
            field_names=tuple(f.name for f in dataclasses.fields(record_type)),
        )
        if codec.header[2:] in by_fingerprint:
            raise RuntimeError(f"{record_type.__name__} has the same fingerprint as another schema")
        by_type[record_type] = codec
        by_fingerprint[codec.header[2:]] = codec
    return by_type, by_fingerprint


_BY_TYPE, _BY_FINGERPRINT = _build()


def encode(record: Any) -> bytes:
    """Single-object Avro bytes for any record dataclass (TypeError for anything else)."""
    codec = _BY_TYPE.get(type(record))
    if codec is None:
        raise TypeError(f"not a callgate record: {type(record).__name__}")
    buffer = io.BytesIO()
    buffer.write(codec.header)
    fastavro.schemaless_writer(buffer, codec.schema, {n: getattr(record, n) for n in codec.field_names})
    return buffer.getvalue()


def _read(data: Any, topic: str | None, partition: int | None, offset: int | None) -> tuple[_Codec, dict]:
    where = {"topic": topic, "partition": partition, "offset": offset}
    if not isinstance(data, (bytes, bytearray, memoryview)):
        # a tombstone (None) or something that is not a Kafka value at all
        raise RecordError(Reason.RECORD_UNDECODABLE, f"no value ({type(data).__name__})", **where)
    data = bytes(data)
    if len(data) < HEADER_LEN or data[:2] != MARKER:
        raise RecordError(Reason.RECORD_UNDECODABLE, f"not single-object Avro ({len(data)} bytes)", **where)
    codec = _BY_FINGERPRINT.get(data[2:HEADER_LEN])
    if codec is None:
        # the fingerprint is a schema id, not record content, so naming it helps and leaks nothing
        raise RecordError(Reason.UNKNOWN_SCHEMA, f"fingerprint {data[2:HEADER_LEN].hex()}", **where)
    stream = io.BytesIO(data)
    stream.seek(HEADER_LEN)
    try:
        body = fastavro.schemaless_reader(stream, codec.schema)
    except Exception as exc:  # fastavro raises EOFError, ValueError, UnicodeDecodeError, IndexError...
        raise RecordError(
            Reason.RECORD_UNDECODABLE, f"{codec.record_type.__name__} body: {type(exc).__name__}", **where
        ) from None
    if stream.tell() != len(data):
        raise RecordError(
            Reason.RECORD_UNDECODABLE,
            f"{codec.record_type.__name__}: {len(data) - stream.tell()} trailing bytes",
            **where,
        )
    return codec, body


def decode(data: bytes, *, topic: str | None = None, partition: int | None = None, offset: int | None = None) -> Any:
    """Decode a record of any callgate type; raises RecordError, never anything else."""
    codec, body = _read(data, topic, partition, offset)
    return codec.record_type(**body)


def decode_dict(
    data: bytes, *, topic: str | None = None, partition: int | None = None, offset: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The schema's short name and the record as a plain dict, for readers with no dataclasses."""
    codec, body = _read(data, topic, partition, offset)
    return codec.record_type.__name__, body
