"""The normalizer's internal vocabulary (DESIGN.md): what every route adapter emits.

Adapters turn one decoded SSE message into a list of these; the accumulator
is the only consumer. Every event keeps `provider_event`, the provider's own
event type (sanitised, see `safe_event_name`), for diagnostics and for the
`provider_event` / `last_provider_event` fields of the records.

`item_key` is the provider's identity of an item *within one response*
(Responses: the item id; Anthropic: the content block index; Chat
Completions: choice and tool_calls index). The accumulator scopes it by
(run, attempt, response), so a key may repeat across responses or attempts.

None of these carries text content except `ArgumentDelta.delta` and the
argument fields of `ItemStarted` / `ItemFinished` (restricted: they only
ever reach `TerminalItem.arguments`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from callgate.errors import Reason


class ItemKind(StrEnum):
    FUNCTION_CALL = "function_call"
    TEXT = "text"
    OTHER = "other"  # reasoning, thinking, server-side tools: never a call


@dataclass(frozen=True, slots=True)
class ResponseStarted:
    provider_event: str
    response_id: str


@dataclass(frozen=True, slots=True)
class ItemStarted:
    provider_event: str
    item_key: str
    kind: ItemKind
    tool_name: str | None = None
    provider_call_id: str | None = None
    # used only when no argument bytes arrive before the terminal (Anthropic's
    # content_block.input, "{}" for a tool that takes no arguments)
    default_arguments: str | None = None


@dataclass(frozen=True, slots=True)
class ArgumentDelta:
    provider_event: str
    item_key: str
    delta: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Visible text: counted (bytes), never accumulated into a call."""

    provider_event: str
    item_key: str | None
    size: int


@dataclass(frozen=True, slots=True)
class ItemFinished:
    provider_event: str
    item_key: str
    # the provider's own copy of the whole arguments, when its terminal event carries one
    # (Responses output_item.done): adopted when no delta came, checked against the buffer otherwise
    final_arguments: str | None = None
    kind: ItemKind | None = None  # when the terminal event itself says what the item was


@dataclass(frozen=True, slots=True)
class ResponseFinished:
    provider_event: str
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class StreamError:
    """The stream can no longer be trusted: every open item of the attempt is quarantined."""

    provider_event: str
    reason: Reason = Reason.STREAM_ERROR
    code: str | None = None  # a safe, provider-declared error class (see safe_code)


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """Counted and kept (its sanitised type) for diagnostics; never advances an item."""

    provider_event: str


Event = (
    ResponseStarted | ItemStarted | ArgumentDelta | TextDelta | ItemFinished
    | ResponseFinished | StreamError | UnknownEvent
)

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,64}")
_SAFE_CODE = re.compile(r"[a-z0-9_.-]{1,64}")


def safe_event_name(name: object) -> str:
    """A provider event type, or "unrecognised" when it could be anything but a type name.

    Event names end up in audit and DLQ records; a provider (or an attacker in
    front of it) must not be able to smuggle content through them.
    """
    return name if isinstance(name, str) and _SAFE_NAME.fullmatch(name) else "unrecognised"


def safe_code(code: object) -> str | None:
    if isinstance(code, str) and _SAFE_CODE.fullmatch(code.lower()):
        return code.lower()
    return None
