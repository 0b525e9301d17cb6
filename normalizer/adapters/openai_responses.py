"""OpenAI Responses API (also CometAPI's Responses route), adapter version 1.

Lifecycle used, and why:
- `response.created` opens the response (its id scopes every item key);
  `response.in_progress` / `response.queued` carry nothing we need.
- `response.output_item.added` opens an item keyed by `item.id`;
  only `type == "function_call"` items are calls (`name`, `call_id`).
- `response.function_call_arguments.delta` appends `delta` to the item named
  by `item_id`. Keyed by id, never by `output_index`: a gateway that rotates
  item ids (GitHub Copilot does, per event) gets its deltas classified
  delta_for_unknown_item and the call quarantined, which fails closed.
- `response.output_item.done` is the item terminal; its `item.arguments` is
  the provider's copy of the whole buffer (adopted when no delta came, as LM
  Studio streams send only `.done`; checked otherwise).
- `response.function_call_arguments.done` and `response.output_text.done`
  are *not* terminals: a text part completing never completes a call.
- `response.completed` is the response terminal; `response.failed`,
  `response.incomplete` and `error` (top-level or nested `error.code`) are
  stream errors.
"""

from __future__ import annotations

from typing import Any

from callgate.errors import Reason

from normalizer.adapters.base import map_typed, mapping, text
from normalizer.events import (
    ArgumentDelta, Event, ItemFinished, ItemKind, ItemStarted, ResponseFinished, ResponseStarted,
    StreamError, TextDelta, UnknownEvent, safe_code,
)

ROUTES = ("openai-responses", "cometapi-responses")
VERSION = "openai-responses/1"

# known events that neither open, feed nor close anything a gate cares about
_IGNORED = frozenset({
    "response.in_progress", "response.queued",
    "response.content_part.added", "response.content_part.done",
    "response.output_text.done", "response.output_text.annotation.added",
    "response.function_call_arguments.done",
    "response.refusal.delta", "response.refusal.done",
    "response.reasoning_summary_part.added", "response.reasoning_summary_part.done",
    "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.reasoning.delta", "response.reasoning.done",
})
_ERRORS = {"response.failed": "response_failed", "response.incomplete": "response_incomplete", "error": None}


def _kind(item_type: object) -> ItemKind:
    if item_type == "function_call":
        return ItemKind.FUNCTION_CALL
    if item_type == "message":
        return ItemKind.TEXT
    return ItemKind.OTHER


def _error_code(obj: dict[str, Any], default: str | None) -> str | None:
    # documented shape: top-level code/message; observed: nested {"error": {...}}, or inside response.error
    if safe_code(obj.get("code")):
        return safe_code(obj.get("code"))
    response = obj.get("response")
    for holder in (obj.get("error"), response.get("error") if isinstance(response, dict) else None):
        if isinstance(holder, dict):
            code = safe_code(holder.get("code")) or safe_code(holder.get("type"))
            if code:
                return code
    return default


class OpenAIResponsesAdapter:
    version = VERSION

    def __init__(self, route: str = ROUTES[0]) -> None:
        self.route = route

    def map(self, event: str, data: str) -> list[Event]:
        if data.strip() == "[DONE]":  # some compatible gateways end with it; the lifecycle already did
            return []
        return map_typed(event, data, self._map)

    def _map(self, name: str, kind: object, obj: dict[str, Any]) -> list[Event]:
        if kind == "response.function_call_arguments.delta":
            return [ArgumentDelta(name, text(obj, "item_id"), text(obj, "delta"))]
        if kind == "response.output_text.delta":
            return [TextDelta(name, obj.get("item_id") if isinstance(obj.get("item_id"), str) else None,
                              len((text(obj, "delta") or "").encode()))]
        if kind == "response.output_item.added":
            item = mapping(obj, "item")
            item_kind = _kind(item.get("type"))
            if item_kind is ItemKind.FUNCTION_CALL:
                return [ItemStarted(name, text(item, "id"), item_kind, text(item, "name"),
                                    text(item, "call_id", required=False))]
            key = item.get("id")
            return [ItemStarted(name, key, item_kind)] if isinstance(key, str) else []
        if kind == "response.output_item.done":
            item = mapping(obj, "item")
            key = text(item, "id")
            item_kind = _kind(item.get("type"))
            final = text(item, "arguments", required=False) if item_kind is ItemKind.FUNCTION_CALL else None
            return [ItemFinished(name, key, final, item_kind)]
        if kind == "response.created":
            return [ResponseStarted(name, text(mapping(obj, "response"), "id"))]
        if kind == "response.completed":
            response = obj.get("response")
            rid = response.get("id") if isinstance(response, dict) else None
            return [ResponseFinished(name, rid if isinstance(rid, str) else None)]
        if kind in _ERRORS:
            return [StreamError(name, Reason.STREAM_ERROR, _error_code(obj, _ERRORS[kind]))]
        if kind in _IGNORED:
            return []
        return [UnknownEvent(name)]
