"""A deliberately naive transcription of the WHATWG event-stream algorithm, for tests only.

It decodes the whole stream to text first and walks it line by line, exactly as
the spec words it; the fast decoder must agree with it on every input.
"""

from __future__ import annotations

import re

from ingest.decoder import SseMessage

_LINE_END = re.compile(r"\r\n|\r|\n")


def reference_decode(stream: bytes) -> tuple[list[SseMessage], bool, int]:
    """Returns (messages, incomplete_at_eof, comment_count)."""
    text = stream.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    pieces = _LINE_END.split(text)
    complete, tail = pieces[:-1], pieces[-1]
    messages: list[SseMessage] = []
    event_type = ""
    data = ""
    last_id = ""
    retry: int | None = None
    pending = False
    comments = 0
    for line in complete:
        if line == "":
            if data:
                if data.endswith("\n"):
                    data = data[:-1]
                messages.append(SseMessage(event_type or "message", data, last_id, retry))
            data = ""
            event_type = ""
            retry = None
            pending = False
            continue
        if line.startswith(":"):
            comments += 1
            continue
        pending = True
        if ":" in line:
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = line, ""
        if name == "event":
            event_type = value
        elif name == "data":
            data += value + "\n"
        elif name == "id":
            if "\x00" not in value:
                last_id = value
        elif name == "retry":
            if value and all(c in "0123456789" for c in value):
                retry = int(value)
    return messages, pending or tail != "", comments
