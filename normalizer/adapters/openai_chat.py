"""OpenAI Chat Completions and OpenAI-compatible gateways, adapter version 1.

Chunks carry `choices[].delta.tool_calls[]` entries keyed by `index` (per
choice); `id` and `function.name` come on the first entry of a call only.
The item key is f"{choice}:{index}" ("{choice}:id:{id}" for gateways that
omit the index, like Mistral; an entry with neither cannot be attributed and
is a delta for an unknown item). A later entry for an open key with a
*different* non-empty id or name is a new call reusing the key (id_reuse);
an empty name on a continuation (Mistral) is not.

Item terminal: a non-null `finish_reason` on the item's choice.
`tool_calls`, `stop` and `function_call` close the choice's open calls
(several compatible servers say `stop` after tool calls). Any other value
(`length`, `content_filter`, unknown ones) means the model was cut: the open
calls are quarantined. Why finish_reason and not `[DONE]`: finish_reason is
the per-choice completion the protocol defines, it arrives in the same chunk
as the whole call on some gateways, and `[DONE]` is absent from many
recorded compatible streams; what follows it (a usage-only chunk) never
carries arguments.

Response terminal: `data: [DONE]`. A call still open at [DONE] (no
finish_reason) is quarantined. A stream cut after finish_reason but before
[DONE] keeps its terminal calls (their terminal already came); the missing
[DONE] only leaves the response unfinished, which the attempt's audit
summary records. Argument bytes after finish_reason are delta_after_terminal.

Other named SSE events (`event: x` with x not "error") are unknown events.
Errors: a chunk with a top-level `error` and no `choices`, or an SSE
`event: error`, is a stream error (Groq's tool_use_failed, for instance).
"""

from __future__ import annotations

from typing import Any

from callgate.errors import Reason

from normalizer.adapters.base import Malformed, malformed, parse_object
from normalizer.events import (
    ArgumentDelta, Event, ItemFinished, ItemKind, ItemStarted, ResponseFinished, ResponseStarted,
    StreamError, TextDelta, UnknownEvent, safe_code, safe_event_name,
)

ROUTES = ("openai-chat",)
VERSION = "openai-chat/1"

CHUNK = "chat.completion.chunk"
DONE = "[DONE]"
_COMPLETE = frozenset({"tool_calls", "stop", "function_call"})


class OpenAIChatAdapter:
    version = VERSION

    def __init__(self, route: str = ROUTES[0]) -> None:
        self.route = route
        self._response_id: str | None = None
        self._open: dict[str, tuple[str | None, str | None]] = {}  # key -> (provider id, name)
        self._by_choice: dict[int, list[str]] = {}

    def map(self, event: str, data: str) -> list[Event]:
        if data.strip() == DONE:
            return [ResponseFinished(DONE, self._response_id)]
        if event not in ("message", "error"):
            # a named event this protocol does not define: counted, and its body never read as a chunk
            return [UnknownEvent(safe_event_name(event))]
        try:
            obj = parse_object(data)
        except Malformed as exc:
            return malformed(CHUNK if event == "message" else event, exc.code)
        if event == "error" or ("error" in obj and "choices" not in obj):
            error = obj.get("error")
            code = None
            if isinstance(error, dict):
                code = safe_code(error.get("code")) or safe_code(error.get("type"))
            return [StreamError("error", Reason.STREAM_ERROR, code)]
        try:
            return self._chunk(obj)
        except Malformed as exc:
            return malformed(CHUNK, exc.code)

    def _chunk(self, obj: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if self._response_id is None:
            rid = obj.get("id")
            self._response_id = rid if isinstance(rid, str) and rid else "chat"
            events.append(ResponseStarted(CHUNK, self._response_id))
        choices = obj.get("choices", [])
        if not isinstance(choices, list):
            raise Malformed("field_choices")
        for choice in choices:
            if not isinstance(choice, dict):
                raise Malformed("field_choices")
            events.extend(self._choice(choice))
        return events

    def _choice(self, choice: dict[str, Any]) -> list[Event]:
        ci = choice.get("index", 0)
        if not isinstance(ci, int) or isinstance(ci, bool):
            raise Malformed("field_index")
        events: list[Event] = []
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise Malformed("field_delta")
        content = delta.get("content")
        if isinstance(content, str) and content:
            events.append(TextDelta(CHUNK, f"{ci}:text", len(content.encode())))
        tool_calls = delta.get("tool_calls") or []
        if not isinstance(tool_calls, list):
            raise Malformed("field_tool_calls")
        for entry in tool_calls:
            if not isinstance(entry, dict):
                raise Malformed("field_tool_calls")
            events.extend(self._tool_call(ci, entry))
        finish = choice.get("finish_reason")
        if finish is not None:
            events.extend(self._finish(ci, finish))
        return events

    def _tool_call(self, ci: int, entry: dict[str, Any]) -> list[Event]:
        index = entry.get("index")
        call_id = entry.get("id") if isinstance(entry.get("id"), str) and entry.get("id") else None
        function = entry.get("function") or {}
        if not isinstance(function, dict):
            raise Malformed("field_function")
        name = function.get("name") if isinstance(function.get("name"), str) and function.get("name") else None
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            raise Malformed("field_arguments")
        if isinstance(index, int) and not isinstance(index, bool):
            key = f"{ci}:{index}"
        elif index is None and call_id is not None:
            key = f"{ci}:id:{call_id}"
        elif index is None:
            key = f"{ci}:unattributed"
        else:
            raise Malformed("field_index")
        events: list[Event] = []
        known = self._open.get(key)
        if (known is None and (call_id or name)) or (
            known is not None and ((call_id and call_id != known[0]) or (name and name != known[1]))
        ):
            if known is None:
                self._by_choice.setdefault(ci, []).append(key)
            self._open[key] = (call_id, name)
            events.append(ItemStarted(CHUNK, key, ItemKind.FUNCTION_CALL, name or "", call_id))
        if arguments:
            events.append(ArgumentDelta(CHUNK, key, arguments))
        return events

    def _finish(self, ci: int, finish: object) -> list[Event]:
        keys = self._by_choice.pop(ci, [])
        for key in keys:
            self._open.pop(key, None)
        label = f"finish_reason:{finish}" if isinstance(finish, str) and safe_code(finish) else "finish_reason"
        if finish in _COMPLETE:
            return [ItemFinished(label, key) for key in keys]
        if keys:
            code = f"finish_{safe_code(finish)}" if safe_code(finish) else "finish_other"
            return [StreamError(label, Reason.STREAM_ENDED_BEFORE_TERMINAL, code)]
        return []
