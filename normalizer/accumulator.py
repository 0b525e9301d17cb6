"""The normalizer core: sse.raw records in, per-item decisions out (sans-I/O).

    run = RunAccumulator(run_id)                 # or Normalizer() for many runs
    for record in records:                       # AttemptStarted | RawSseMessage | TransportEnd
        for out in run.feed(record):             # TerminalItem | DeadLetter | AuditRecord | RetainedBuffer
            ...

One `_Attempt` per AttemptStarted, with its own adapter instance and its own
items: a retry never sees, and never appends to, an earlier attempt's buffers.
Items are keyed by (response id, provider item key) inside the attempt, i.e.
(run, attempt, response, item) overall; never by tool name or position in
the stream. Only function-call items become calls; text and other items are
tracked so their events are recognised, and text is only counted.

Every function-call item that opens gets exactly one decision:
- its terminal event arrives: a TerminalItem (state ITEM_TERMINAL; the
  validator decides the rest) plus an audit record;
- otherwise QUARANTINED, as a DeadLetter plus an audit record, when: the
  stream reports an error or a provider event is malformed (every open item
  of the attempt), the response ends or is superseded by another response
  while it is open, the transport ends (TransportEnd, including the
  normalizer's own `run_idle_deadline` marker), a new attempt of the run
  starts, its id is reused by a new item, its buffer passes the size cap, or
  the provider's own copy of the arguments at the terminal differs from the
  accumulated bytes.
Stream anomalies that are not an open item's decision (a delta for an item
nobody opened, a delta after the terminal, a second terminal, an id reused
after its item ended, a record for an attempt with no open state) are
DeadLetters without a call id. After an attempt's first stream error its
later events are only counted.

Time: every timestamp written comes from the records (received_at,
ended_at, started_at), never from a clock, so replaying the same records
gives the same outputs (call ids apart: fresh random ones, never derived
from content). Idle deadlines are driven from outside (`idle_attempts`):
the worker turns them into a TransportEnd record with reason
`run_idle_deadline` on the input topic, so the quarantine itself is
replayable input.

Output never carries arguments except TerminalItem (restricted topic) and
RetainedBuffer (only when the data-handling setting keeps quarantined
buffers; restricted as well).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from callgate.errors import Reason, StreamError as StreamFailure
from callgate.records import (
    AttemptStarted, AuditRecord, DeadLetter, QuarantinedBuffer, RawSseMessage, TerminalItem, TransportEnd,
)
from callgate.states import ItemState

from normalizer.adapters import Adapter, get_adapter
from normalizer.events import (
    ArgumentDelta, Event, ItemFinished, ItemKind, ItemStarted, ResponseFinished, ResponseStarted,
    StreamError, TextDelta, UnknownEvent,
)

STAGE = "normalizer"
IDLE_MARKER_REASON = Reason.RUN_IDLE_DEADLINE.value
NO_RESPONSE = "-"  # items that arrive before any response-start event
MAX_KEPT_UNKNOWN_TYPES = 8

InputRecord = AttemptStarted | RawSseMessage | TransportEnd


@dataclass(frozen=True, slots=True)
class Limits:
    # A memory guard, above the validator's own parse limit (1 MiB) so that
    # limit is what normally rejects a big call; this one stops unbounded growth.
    max_item_bytes: int = 4 << 20
    idle_deadline_ms: int = 120_000


RetainedBuffer = QuarantinedBuffer  # written to the restricted quarantine topic


Output = TerminalItem | DeadLetter | AuditRecord | RetainedBuffer


def new_call_id() -> str:
    return f"cg_{secrets.token_hex(16)}"


class _Phase(StrEnum):
    OPEN = "open"
    TERMINAL = "terminal"
    QUARANTINED = "quarantined"
    CLOSED = "closed"  # a text / other item that finished


@dataclass(slots=True)
class _Item:
    response_id: str
    key: str
    kind: ItemKind
    call_id: str | None
    tool_name: str | None
    provider_call_id: str | None
    default_arguments: str | None
    buffer: bytearray = field(default_factory=bytearray)
    deltas: int = 0
    phase: _Phase = _Phase.OPEN
    last_event: str = ""
    poisoned: bool = False  # an anomaly was reported for it: later events only counted

    @property
    def is_call(self) -> bool:
        return self.kind is ItemKind.FUNCTION_CALL


@dataclass(slots=True)
class _Attempt:
    record: AttemptStarted
    adapter: Adapter | None
    items: dict[tuple[str, str], _Item] = field(default_factory=dict)
    response_id: str | None = None
    response_open: bool = False
    responses_finished: int = 0
    failed: bool = False
    last_seq: int | None = None
    last_event: str | None = None
    last_activity_ms: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    unknown_types: list[str] = field(default_factory=list)

    @property
    def attempt_id(self) -> str:
        return self.record.attempt_id

    def open_calls(self, response_id: str | None = None) -> list[_Item]:
        return [
            item for item in self.items.values()
            if item.is_call and item.phase is _Phase.OPEN
            and (response_id is None or item.response_id == response_id)
        ]


class RunAccumulator:
    """One run's state: at most one open attempt at a time."""

    def __init__(
        self,
        run_id: str,
        *,
        limits: Limits = Limits(),
        keep_raw: bool = False,
        call_ids: Callable[[], str] = new_call_id,
    ) -> None:
        self.run_id = run_id
        self.limits = limits
        self.keep_raw = keep_raw
        self.call_ids = call_ids
        self.attempt: _Attempt | None = None

    @property
    def open(self) -> bool:
        return self.attempt is not None

    def idle(self, now_ms: int) -> bool:
        return self.attempt is not None and now_ms - self.attempt.last_activity_ms >= self.limits.idle_deadline_ms

    def open_items(self) -> int:
        return 0 if self.attempt is None else len(self.attempt.open_calls())

    # ------------------------------------------------------------ records

    def feed(self, record: InputRecord) -> list[Output]:
        if isinstance(record, AttemptStarted):
            return self._attempt_started(record)
        attempt = self.attempt
        if attempt is None or record.attempt_id != attempt.attempt_id:
            return stray(record)
        if isinstance(record, TransportEnd):
            return self._transport_end(attempt, record)
        return self._message(attempt, record)

    def _attempt_started(self, record: AttemptStarted) -> list[Output]:
        out: list[Output] = []
        if self.attempt is not None:
            if self.attempt.attempt_id == record.attempt_id:
                return []  # the same attempt announced twice
            old = self.attempt
            # the old attempt never got its TransportEnd (its ingest died): nothing of it goes on
            for item in old.open_calls():
                out += self._quarantine(old, item, Reason.STREAM_ENDED_BEFORE_TERMINAL, "attempt_superseded",
                                        record.started_at)
            out.append(self._summary(old, record.started_at, "attempt_superseded"))
        try:
            adapter: Adapter | None = get_adapter(record.route)
        except StreamFailure:
            adapter = None
        self.attempt = _Attempt(record, adapter, last_activity_ms=record.started_at)
        if adapter is None:
            self.attempt.failed = True
            out += self._anomaly(self.attempt, Reason.UNKNOWN_ROUTE, None, None, 0, None, record.started_at)
        return out

    def _transport_end(self, attempt: _Attempt, record: TransportEnd) -> list[Output]:
        idle = record.reason == IDLE_MARKER_REASON
        reason = Reason.RUN_IDLE_DEADLINE if idle else Reason.STREAM_ENDED_BEFORE_TERMINAL
        out: list[Output] = []
        for item in attempt.open_calls():
            out += self._quarantine(attempt, item, reason, _safe_detail(record.reason), record.ended_at)
        out.append(self._summary(attempt, record.ended_at, _safe_detail(record.reason)))
        self.attempt = None
        return out

    def _message(self, attempt: _Attempt, record: RawSseMessage) -> list[Output]:
        attempt.last_activity_ms = max(attempt.last_activity_ms, record.received_at)
        if attempt.last_seq is not None and record.seq <= attempt.last_seq:
            attempt.counters["duplicate_records"] += 1  # a redelivered message: already applied
            return []
        gap = attempt.last_seq is not None and record.seq != attempt.last_seq + 1
        attempt.last_seq = record.seq
        attempt.counters["messages"] += 1
        if attempt.failed:
            attempt.counters["after_error"] += 1
            return []
        if gap:
            # a message went missing between ingest and us: no open buffer can be trusted
            return self._event(attempt, StreamError("seq_gap", Reason.STREAM_ERROR, "seq_gap"), record.received_at)
        assert attempt.adapter is not None
        out: list[Output] = []
        for event in attempt.adapter.map(record.event, record.data):
            out += self._event(attempt, event, record.received_at)
            if attempt.failed:
                break
        return out

    # ------------------------------------------------------------ events

    def _event(self, attempt: _Attempt, event: Event, at: int) -> list[Output]:
        attempt.last_event = event.provider_event
        if isinstance(event, ArgumentDelta):
            return self._delta(attempt, event, at)
        if isinstance(event, TextDelta):
            attempt.counters["text_bytes"] += event.size
            return []
        if isinstance(event, ItemStarted):
            return self._item_started(attempt, event, at)
        if isinstance(event, ItemFinished):
            return self._item_finished(attempt, event, at)
        if isinstance(event, ResponseStarted):
            return self._response_started(attempt, event, at)
        if isinstance(event, ResponseFinished):
            attempt.responses_finished += 1
            out: list[Output] = []
            for item in attempt.open_calls(attempt.response_id or NO_RESPONSE):
                out += self._quarantine(attempt, item, Reason.STREAM_ENDED_BEFORE_TERMINAL, "response_finished", at)
            attempt.response_open = False
            return out
        if isinstance(event, StreamError):
            attempt.failed = True
            attempt.counters["stream_errors"] += 1
            out = []
            for item in attempt.open_calls():
                out += self._quarantine(attempt, item, event.reason, event.code, at)
            if not out:  # nothing open to blame: still a classified, visible outcome
                out = self._anomaly(attempt, event.reason, attempt.response_id, None, 0, event.provider_event, at,
                                    detail=event.code)
            return out
        assert isinstance(event, UnknownEvent)
        attempt.counters["unknown_events"] += 1
        if event.provider_event not in attempt.unknown_types and len(attempt.unknown_types) < MAX_KEPT_UNKNOWN_TYPES:
            attempt.unknown_types.append(event.provider_event)
        return []

    def _response_started(self, attempt: _Attempt, event: ResponseStarted, at: int) -> list[Output]:
        if attempt.response_open and attempt.response_id == event.response_id:
            attempt.counters["duplicate_response_starts"] += 1  # a proxy replaying the start: no-op
            return []
        out: list[Output] = []
        if attempt.response_open:
            for item in attempt.open_calls(attempt.response_id):
                out += self._quarantine(attempt, item, Reason.STREAM_ENDED_BEFORE_TERMINAL, "response_superseded", at)
        attempt.response_id = event.response_id
        attempt.response_open = True
        attempt.counters["responses"] += 1
        return out

    def _item_started(self, attempt: _Attempt, event: ItemStarted, at: int) -> list[Output]:
        rid = attempt.response_id or NO_RESPONSE
        key = (rid, event.item_key)
        existing = attempt.items.get(key)
        if existing is not None:
            if not existing.is_call and event.kind is not ItemKind.FUNCTION_CALL:
                attempt.counters["repeated_non_call_items"] += 1
                return []
            if existing.is_call and existing.phase is _Phase.OPEN:
                return self._quarantine(attempt, existing, Reason.ID_REUSE, "item_key", at, poison=True)
            if existing.poisoned:
                return []
            existing.poisoned = True
            return self._anomaly(attempt, Reason.ID_REUSE, rid, event.item_key, 0, event.provider_event, at,
                                 detail="item_key")
        item = _Item(
            response_id=rid, key=event.item_key, kind=event.kind,
            call_id=self.call_ids() if event.kind is ItemKind.FUNCTION_CALL else None,
            tool_name=event.tool_name, provider_call_id=event.provider_call_id,
            default_arguments=event.default_arguments, last_event=event.provider_event,
        )
        attempt.items[key] = item
        if item.is_call and item.provider_call_id is not None and any(
            other is not item and other.is_call and other.response_id == rid
            and other.provider_call_id == item.provider_call_id
            for other in attempt.items.values()
        ):
            # a follow-up result could not say which of the two it answers
            return self._quarantine(attempt, item, Reason.ID_REUSE, "provider_call_id", at)
        return []

    def _delta(self, attempt: _Attempt, event: ArgumentDelta, at: int) -> list[Output]:
        rid = attempt.response_id or NO_RESPONSE
        item = attempt.items.get((rid, event.item_key))
        size = len(event.delta.encode("utf-8", "surrogatepass"))
        if item is not None and item.poisoned:
            attempt.counters["bytes_after_decision"] += size
            return []
        if item is None or not item.is_call:
            return self._anomaly(attempt, Reason.DELTA_FOR_UNKNOWN_ITEM, rid, event.item_key, size,
                                 event.provider_event, at, detail=None if item is None else "not_a_call")
        if item.poisoned or item.phase is _Phase.QUARANTINED:
            attempt.counters["bytes_after_decision"] += size
            return []
        if item.phase is _Phase.TERMINAL:
            item.poisoned = True
            return self._anomaly(attempt, Reason.DELTA_AFTER_TERMINAL, rid, item.key, size,
                                 event.provider_event, at, call_id=item.call_id)
        item.last_event = event.provider_event
        item.deltas += 1
        item.buffer += event.delta.encode("utf-8", "surrogatepass")
        if len(item.buffer) > self.limits.max_item_bytes:
            return self._quarantine(attempt, item, Reason.ITEM_TOO_LARGE, None, at)
        return []

    def _item_finished(self, attempt: _Attempt, event: ItemFinished, at: int) -> list[Output]:
        rid = attempt.response_id or NO_RESPONSE
        item = attempt.items.get((rid, event.item_key))
        if item is None:
            if event.kind not in (None, ItemKind.FUNCTION_CALL):
                attempt.counters["unmatched_non_call_terminals"] += 1  # e.g. a gateway rotating text item ids
                return []
            return self._anomaly(attempt, Reason.DELTA_FOR_UNKNOWN_ITEM, rid, event.item_key, 0,
                                 event.provider_event, at, detail="terminal_for_unknown_item")
        if item.poisoned:
            attempt.counters["events_after_decision"] += 1
            return []
        if not item.is_call:
            item.phase = _Phase.CLOSED
            return []
        if item.poisoned or item.phase is _Phase.QUARANTINED:
            attempt.counters["events_after_decision"] += 1
            return []
        if item.phase is _Phase.TERMINAL:
            item.poisoned = True
            return self._anomaly(attempt, Reason.DUPLICATE_ITEM, rid, item.key, 0, event.provider_event, at,
                                 call_id=item.call_id)
        item.last_event = event.provider_event
        if not item.buffer:
            # no argument bytes streamed: the provider's own whole copy (or the block's declared input)
            adopted = event.final_arguments if event.final_arguments is not None else item.default_arguments
            item.buffer += (adopted or "").encode("utf-8", "surrogatepass")
        elif event.final_arguments is not None and event.final_arguments.encode("utf-8", "surrogatepass") != item.buffer:
            return self._quarantine(attempt, item, Reason.MALFORMED_PROVIDER_EVENT, "arguments_mismatch", at)
        if len(item.buffer) > self.limits.max_item_bytes:
            return self._quarantine(attempt, item, Reason.ITEM_TOO_LARGE, None, at)
        return self._terminal(attempt, item, event.provider_event, at)

    # ------------------------------------------------------------ decisions

    def _tool_label(self, attempt: _Attempt, name: str | None) -> str | None:
        # a tool name outside the run's tool set is model-chosen text: never publish it
        if name is None:
            return None
        return name if name in attempt.record.tool_set else "unregistered"

    def _terminal(self, attempt: _Attempt, item: _Item, provider_event: str, at: int) -> list[Output]:
        item.phase = _Phase.TERMINAL
        rec = attempt.record
        assert item.call_id is not None
        terminal = TerminalItem(
            run_id=self.run_id, attempt_id=rec.attempt_id, response_id=item.response_id, item_id=item.key,
            call_id=item.call_id, provider_call_id=item.provider_call_id, tool_name=item.tool_name or "",
            arguments=bytes(item.buffer), route=rec.route, adapter_version=_version(attempt),
            provider_event=provider_event, tool_set=list(rec.tool_set), policy_id=rec.policy_id, terminal_at=at,
        )
        audit = self._audit(attempt, item, ItemState.ITEM_TERMINAL, provider_event, at, terminal_seen=True)
        return [terminal, audit]

    def _quarantine(
        self, attempt: _Attempt, item: _Item, reason: Reason, detail: str | None, at: int, *, poison: bool = False
    ) -> list[Output]:
        item.phase = _Phase.QUARANTINED
        item.poisoned = item.poisoned or poison
        rec = attempt.record
        dead = DeadLetter(
            stage=STAGE, state=ItemState.QUARANTINED.value, reason=reason.value, run_id=self.run_id,
            attempt_id=rec.attempt_id, response_id=item.response_id, item_id=item.key, call_id=item.call_id,
            route=rec.route, tool_category=self._tool_label(attempt, item.tool_name), byte_count=len(item.buffer),
            last_provider_event=item.last_event or attempt.last_event, observed_at=at, detail_code=detail,
        )
        out: list[Output] = [
            dead,
            self._audit(attempt, item, ItemState.QUARANTINED, item.last_event, at, error=reason, detail=detail),
        ]
        if self.keep_raw:
            assert item.call_id is not None
            out.append(RetainedBuffer(self.run_id, rec.attempt_id, item.response_id, item.key, item.call_id,
                                      reason.value, bytes(item.buffer), at))
        item.buffer = bytearray()  # dropped (or handed over above): never reused
        return out

    def _anomaly(
        self, attempt: _Attempt, reason: Reason, response_id: str | None, item_key: str | None, size: int,
        provider_event: str | None, at: int, *, detail: str | None = None, call_id: str | None = None,
    ) -> list[Output]:
        attempt.counters[f"anomaly_{reason.value}"] += 1
        rec = attempt.record
        dead = DeadLetter(
            stage=STAGE, state=ItemState.QUARANTINED.value, reason=reason.value, run_id=self.run_id,
            attempt_id=rec.attempt_id, response_id=response_id, item_id=item_key, call_id=None, route=rec.route,
            tool_category=None, byte_count=size, last_provider_event=provider_event, observed_at=at,
            detail_code=detail,
        )
        audit = AuditRecord(
            observed_at=at, stage=STAGE, run_id=self.run_id, attempt_id=rec.attempt_id, response_id=response_id,
            item_id=item_key, call_id=call_id, model_route=rec.route, stream_event=provider_event, tool_name=None,
            buffer_bytes=size, terminal_seen=False, json_status=None, trailing_data=None, schema_status=None,
            policy_status=None, execution_state=None, state=ItemState.QUARANTINED.value, error_class=reason.value,
            extra={"kind": "stream_anomaly", **({"detail_code": detail} if detail else {})},
        )
        return [dead, audit]

    def _audit(
        self, attempt: _Attempt, item: _Item, state: ItemState, provider_event: str | None, at: int, *,
        terminal_seen: bool = False, error: Reason | None = None, detail: str | None = None,
    ) -> AuditRecord:
        rec = attempt.record
        extra = {"adapter_version": _version(attempt), "deltas": str(item.deltas)}
        if detail:
            extra["detail_code"] = detail
        return AuditRecord(
            observed_at=at, stage=STAGE, run_id=self.run_id, attempt_id=rec.attempt_id,
            response_id=item.response_id, item_id=item.key, call_id=item.call_id, model_route=rec.route,
            stream_event=provider_event, tool_name=self._tool_label(attempt, item.tool_name),
            buffer_bytes=len(item.buffer), terminal_seen=terminal_seen, json_status=None, trailing_data=None,
            schema_status=None, policy_status=None, execution_state=None, state=state.value,
            error_class=error.value if error else None, extra=extra,
        )

    def _summary(self, attempt: _Attempt, at: int, ended: str | None) -> AuditRecord:
        """The attempt's diagnostics: counters and the unknown event types seen (sanitised names)."""
        rec = attempt.record
        extra = {k: str(v) for k, v in sorted(attempt.counters.items())}
        extra["kind"] = "attempt_summary"
        extra["adapter_version"] = _version(attempt)
        extra["responses_finished"] = str(attempt.responses_finished)
        extra["response_open_at_end"] = str(attempt.response_open).lower()
        if attempt.unknown_types:
            extra["unknown_event_types"] = ",".join(attempt.unknown_types)
        if ended:
            extra["ended"] = ended
        calls = [i for i in attempt.items.values() if i.is_call]
        extra["calls"] = str(len(calls))
        return AuditRecord(
            observed_at=at, stage=STAGE, run_id=self.run_id, attempt_id=rec.attempt_id,
            response_id=attempt.response_id, item_id=None, call_id=None, model_route=rec.route,
            stream_event=attempt.last_event, tool_name=None, buffer_bytes=None, terminal_seen=False,
            json_status=None, trailing_data=None, schema_status=None, policy_status=None, execution_state=None,
            state=ItemState.RECEIVING.value, error_class=None, extra=extra,
        )


def _version(attempt: _Attempt) -> str:
    return attempt.adapter.version if attempt.adapter is not None else attempt.record.adapter_version


def _safe_detail(text: str) -> str | None:
    try:
        return Reason(text).value
    except ValueError:
        return "other"


def stray(record: RawSseMessage | TransportEnd) -> list[Output]:
    """A record for an attempt with no open state here. A late TransportEnd (or a
    second idle marker) is expected and silent; a message is reported."""
    if isinstance(record, TransportEnd):
        return []
    dead = DeadLetter(
        stage=STAGE, state=ItemState.QUARANTINED.value, reason=Reason.UNKNOWN_ATTEMPT.value, run_id=record.run_id,
        attempt_id=record.attempt_id, response_id=None, item_id=None, call_id=None, route=record.route,
        tool_category=None, byte_count=len(record.data.encode("utf-8", "surrogatepass")),
        last_provider_event=None, observed_at=record.received_at, detail_code=None,
    )
    return [dead]


@dataclass(frozen=True, slots=True)
class IdleAttempt:
    run_id: str
    attempt_id: str
    route: str


class Normalizer:
    """Many runs (one partition's worth): routes records to their RunAccumulator.

    A run's state lives from an AttemptStarted until that attempt's
    TransportEnd; `first_offset` remembers where the open attempt began, so a
    worker can replay from the oldest open one (`replay_from`).
    """

    def __init__(self, *, limits: Limits = Limits(), keep_raw: bool = False,
                 call_ids: Callable[[], str] = new_call_id) -> None:
        self.limits = limits
        self.keep_raw = keep_raw
        self.call_ids = call_ids
        self.runs: dict[str, RunAccumulator] = {}
        self.first_offset: dict[str, int] = {}

    def feed(self, record: InputRecord, offset: int = 0) -> list[Output]:
        run = self.runs.get(record.run_id)
        if run is None:
            if not isinstance(record, AttemptStarted):
                return stray(record)
            run = self.runs[record.run_id] = RunAccumulator(
                record.run_id, limits=self.limits, keep_raw=self.keep_raw, call_ids=self.call_ids
            )
        before = run.attempt.attempt_id if run.attempt is not None else None
        out = run.feed(record)
        if run.attempt is None:
            del self.runs[record.run_id]
            self.first_offset.pop(record.run_id, None)
        elif run.attempt.attempt_id != before:
            self.first_offset[record.run_id] = offset
        return out

    def feed_all(self, records: Iterable[InputRecord]) -> list[Output]:
        out: list[Output] = []
        for record in records:
            out += self.feed(record)
        return out

    def idle_attempts(self, now_ms: int) -> list[IdleAttempt]:
        return [
            IdleAttempt(run.run_id, run.attempt.attempt_id, run.attempt.record.route)
            for run in self.runs.values()
            if run.attempt is not None and run.idle(now_ms)
        ]

    def replay_from(self, next_offset: int) -> int:
        return min(self.first_offset.values(), default=next_offset)
