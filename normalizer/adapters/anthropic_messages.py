"""Anthropic Messages streaming, adapter version 1.

- `message_start` opens the response (`message.id`). A second one with a
  different id while blocks are open (a proxy splicing two generations) makes
  the accumulator quarantine the first message's open calls; the same id again
  (a proxy replay) is a no-op.
- `content_block_start` opens the block keyed by its `index` within the
  message; `tool_use` blocks are calls (`name`, `id`). `server_tool_use` and
  other block types run elsewhere or are not calls.
- `content_block_delta` with `input_json_delta.partial_json` appends;
  `text_delta` is text; thinking / signature / citations deltas are ignored.
- `content_block_stop` is the item terminal. A tool block that got no
  argument bytes at all takes `content_block.input` (`{}` for a tool with no
  parameters), as the Messages API defines it.
- `message_stop` is the response terminal (`message_delta` only carries the
  stop reason; a block cut by max_tokens never gets its stop and is
  quarantined at message_stop).
- `ping` is ignored; `error` (e.g. overloaded_error) is a stream error.
"""

from __future__ import annotations

import json
from typing import Any

from callgate.errors import Reason

from normalizer.adapters.base import Malformed, map_typed, mapping, text
from normalizer.events import (
    ArgumentDelta, Event, ItemFinished, ItemKind, ItemStarted, ResponseFinished, ResponseStarted,
    StreamError, TextDelta, UnknownEvent, safe_code, safe_event_name,
)

ROUTES = ("anthropic-messages",)
VERSION = "anthropic-messages/1"

_IGNORED_DELTAS = frozenset({"thinking_delta", "signature_delta", "citations_delta"})


def _index(obj: dict[str, Any]) -> str:
    index = obj.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise Malformed("field_index")
    return str(index)


class AnthropicMessagesAdapter:
    version = VERSION

    def __init__(self, route: str = ROUTES[0]) -> None:
        self.route = route

    def map(self, event: str, data: str) -> list[Event]:
        return map_typed(event, data, self._map)

    def _map(self, name: str, kind: object, obj: dict[str, Any]) -> list[Event]:
        if kind == "content_block_delta":
            key = _index(obj)
            delta = mapping(obj, "delta")
            dtype = delta.get("type")
            if dtype == "input_json_delta":
                return [ArgumentDelta(f"{name}.input_json_delta", key, text(delta, "partial_json"))]
            if dtype == "text_delta":
                return [TextDelta(f"{name}.text_delta", key, len(text(delta, "text").encode()))]
            if dtype in _IGNORED_DELTAS:
                return []
            return [UnknownEvent(f"{name}.{safe_event_name(dtype)}")]
        if kind == "content_block_start":
            key = _index(obj)
            block = mapping(obj, "content_block")
            btype = block.get("type")
            if btype == "tool_use":
                initial = block.get("input", {})
                default = json.dumps(initial, separators=(",", ":")) if isinstance(initial, dict) else None
                return [ItemStarted(name, key, ItemKind.FUNCTION_CALL, text(block, "name"),
                                    text(block, "id", required=False), default)]
            return [ItemStarted(name, key, ItemKind.TEXT if btype == "text" else ItemKind.OTHER)]
        if kind == "content_block_stop":
            return [ItemFinished(name, _index(obj))]
        if kind == "message_start":
            return [ResponseStarted(name, text(mapping(obj, "message"), "id"))]
        if kind == "message_stop":
            return [ResponseFinished(name)]
        if kind in ("ping", "message_delta"):
            return []
        if kind == "error":
            error = obj.get("error")
            code = safe_code(error.get("type")) if isinstance(error, dict) else None
            return [StreamError(name, Reason.STREAM_ERROR, code)]
        return [UnknownEvent(name)]
