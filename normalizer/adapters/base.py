"""What every route adapter shares: the protocol and strict handling of event data.

An adapter is sans-I/O and holds per-attempt state (a fresh instance per
attempt, from `get_adapter`): `map(event, data)` takes one decoded SSE message
(its event name and data string) and returns internal events. It never
raises on provider input: data that is not a JSON object is a
`StreamError(MALFORMED_PROVIDER_EVENT)`, a type it does not know is an
`UnknownEvent`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from callgate.errors import Reason

from normalizer.events import Event, StreamError, safe_event_name


class Adapter(Protocol):
    route: str
    version: str

    def map(self, event: str, data: str) -> list[Event]: ...


class Malformed(Exception):
    """Internal: the event's JSON does not have the shape this adapter version expects."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def parse_object(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise Malformed("invalid_json") from None
    if not isinstance(value, dict):
        raise Malformed("not_an_object")
    return value


TypedHandler = Callable[[str, object, dict[str, Any]], list[Event]]


def map_typed(event: str, data: str, handler: TypedHandler) -> list[Event]:
    """Parse an event object tagged by its `type` and pass it to the route's handler.

    The shape of both the Responses and the Messages protocols: malformed data,
    or a field of the wrong shape found by the handler, is a classified
    stream error named after the (sanitized) event type, never an exception.
    """
    try:
        obj = parse_object(data)
    except Malformed as exc:
        return malformed(event, exc.code)
    kind = obj.get("type", event)
    name = safe_event_name(kind)
    try:
        return handler(name, kind, obj)
    except Malformed as exc:
        return malformed(name, exc.code)


def malformed(provider_event: str, code: str) -> list[Event]:
    return [StreamError(safe_event_name(provider_event), Reason.MALFORMED_PROVIDER_EVENT, code)]


def text(obj: dict[str, Any], key: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise Malformed(f"field_{key}")
    return value


def mapping(obj: dict[str, Any], key: str) -> dict[str, Any]:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise Malformed(f"field_{key}")
    return value
