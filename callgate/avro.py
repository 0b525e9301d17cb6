"""Avro single-object encoding of callgate's records, with fastavro.

Wire format (Avro specification, "Single-object encoding"): the two bytes
C3 01, the schema's 8-byte CRC-64-AVRO fingerprint of its Parsing Canonical
Form (little-endian), then the schemaless binary body. The fingerprint picks
the schema, so one topic may carry several record types (sse.raw carries
AttemptStarted, RawSseMessage and TransportEnd) and an audit consumer needs
nothing but the files in `schemas/` to decode any record.

Every decoding failure raises `RecordError` naming topic, partition and
offset, with no record bytes in the message. A worker treats it as a poison
record: it parks it (a dead letter with reason `record_undecodable`) and
moves on, instead of crashing and re-reading the same offset forever.
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

RECORD_TYPES: tuple[type, ...] = (
    records.RunRequest,
    records.AttemptStarted,
    records.RawSseMessage,
    records.TransportEnd,
    records.TerminalItem,
    records.DeadLetter,
    records.QuarantinedBuffer,
    records.PendingCall,
    records.Approval,
    records.ApprovedCall,
    records.ToolResult,
    records.LedgerEntry,
    records.AuditRecord,
)


@dataclass(frozen=True, slots=True)
class _Codec:
    record_type: type
    schema: Any  # parsed by fastavro
    header: bytes
    field_names: tuple[str, ...]


def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    parsed = fastavro.parse_schema(schema)
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


def load_schemas(schema_dir: Path = SCHEMA_DIR) -> dict[str, dict[str, Any]]:
    """Every record schema by its short name, as written in the .avsc files."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(schema_dir.glob("*.avsc")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        out[schema["name"]] = schema
    return out


def _build() -> tuple[dict[type, _Codec], dict[bytes, _Codec]]:
    schemas = load_schemas()
    by_type: dict[type, _Codec] = {}
    by_fingerprint: dict[bytes, _Codec] = {}
    for record_type in RECORD_TYPES:
        raw = schemas[record_type.__name__]
        codec = _Codec(
            record_type=record_type,
            schema=fastavro.parse_schema(raw),
            header=MARKER + schema_fingerprint(raw),
            field_names=tuple(f.name for f in dataclasses.fields(record_type)),
        )
        by_type[record_type] = codec
        by_fingerprint[codec.header[2:]] = codec
    return by_type, by_fingerprint


_BY_TYPE, _BY_FINGERPRINT = _build()


def encode(record: Any) -> bytes:
    codec = _BY_TYPE.get(type(record))
    if codec is None:
        raise TypeError(f"not a callgate record: {type(record).__name__}")
    buffer = io.BytesIO()
    buffer.write(codec.header)
    fastavro.schemaless_writer(buffer, codec.schema, {n: getattr(record, n) for n in codec.field_names})
    return buffer.getvalue()


def _read(data: bytes, topic: str | None, partition: int | None, offset: int | None) -> tuple[_Codec, dict]:
    where = {"topic": topic, "partition": partition, "offset": offset}
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(Reason.RECORD_UNDECODABLE, "no value", **where)
    if len(data) < HEADER_LEN or data[:2] != MARKER:
        raise RecordError(Reason.RECORD_UNDECODABLE, f"not single-object Avro ({len(data)} bytes)", **where)
    codec = _BY_FINGERPRINT.get(bytes(data[2:HEADER_LEN]))
    if codec is None:
        raise RecordError(Reason.UNKNOWN_SCHEMA, f"fingerprint {bytes(data[2:HEADER_LEN]).hex()}", **where)
    stream = io.BytesIO(data[HEADER_LEN:])
    try:
        body = fastavro.schemaless_reader(stream, codec.schema)
    except Exception as exc:  # fastavro raises EOFError, ValueError, UnicodeDecodeError, ...
        raise RecordError(
            Reason.RECORD_UNDECODABLE, f"{codec.record_type.__name__} body: {type(exc).__name__}", **where
        ) from None
    if stream.tell() != len(data) - HEADER_LEN:
        raise RecordError(Reason.RECORD_UNDECODABLE, f"{codec.record_type.__name__}: trailing bytes", **where)
    return codec, body


def decode(data: bytes, *, topic: str | None = None, partition: int | None = None, offset: int | None = None) -> Any:
    """Decode a record of any callgate type; raises RecordError, never anything else."""
    codec, body = _read(data, topic, partition, offset)
    return codec.record_type(**body)


def decode_dict(
    data: bytes, *, topic: str | None = None, partition: int | None = None, offset: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The schema name and the record as a plain dict, for readers with no dataclasses."""
    codec, body = _read(data, topic, partition, offset)
    return codec.record_type.__name__, body
