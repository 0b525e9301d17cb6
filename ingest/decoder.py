"""A sans-I/O decoder for the WHATWG `text/event-stream` format.

Feed it bytes in any chunking; it returns the messages that a blank line
completed. It imports neither httpx nor Kafka, so it is tested with plain bytes.

Why it works on bytes and decodes per message rather than decoding the stream
first: CR (0x0D), LF (0x0A) and ':' (0x3A) are ASCII, and UTF-8 never uses an
ASCII byte inside a multi-byte sequence. Python's decoder replaces *maximal
subparts* of ill-formed sequences, so an ASCII byte always ends an ill-formed
sequence and is decoded as itself. Splitting the raw bytes at those three bytes
and decoding each piece with errors="replace" therefore yields exactly the text
that an incremental decoder over the whole stream would, however the chunks
fall; a multi-byte sequence split across chunks stays intact because a partial
line is kept as bytes until its line end arrives.

Rules implemented (https://html.spec.whatwg.org/multipage/server-sent-events.html):
* one leading BOM (EF BB BF) is dropped, also when split across chunks;
* lines end at CRLF, LF or CR; a CR ending one chunk and an LF starting the
  next are one line end;
* an empty line dispatches; a message whose data buffer is empty is not
  dispatched (its event type is reset, the last event id still persists);
* `data` values are joined with "\\n"; `event` sets the type (default
  "message"); `id` sets the last event id unless it contains NUL, and the last
  event id persists across messages; `retry` is honoured only when it is
  ASCII digits; unknown fields are ignored;
* a line starting with ':' is a comment: counted, never dispatched;
* after the first ':' one leading space of the value is stripped; a line with
  no ':' is a field name with an empty value;
* at end of stream an unterminated message is discarded, and `close()`
  reports that it was there.

Limits, and what happens after one is broken: a line longer than
`max_line_bytes`, or a message whose data buffer exceeds `max_message_bytes`,
raises `SseLimitExceeded` (an `SseError` with reason SSE_LINE_TOO_LONG or
SSE_MESSAGE_TOO_LARGE). Messages completed earlier in the same chunk are on
the exception (`dispatched`), so nothing complete is lost. The decoder is then
failed: every later `feed()` raises the same reason again, and `close()`
reports the failure. A framing error means the rest of the stream cannot be
trusted, so the worker publishes what was dispatched and ends the attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from callgate.errors import Reason, SseError

DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class SseMessage:
    event: str  # "message" when the stream named none
    data: str
    last_event_id: str  # "" until an id field sets it; persists across messages
    retry: int | None = None  # a valid retry field inside this message, if any


@dataclass(frozen=True, slots=True)
class EndOfStream:
    incomplete: bool  # an unterminated message (or partial line) was pending: never dispatched
    pending_bytes: int  # raw bytes of that pending message, for diagnostics
    messages: int
    comments: int
    bytes_fed: int
    error: Reason | None = None  # set when a limit failed the decoder
    last_event_id: str = ""
    retry: int | None = None  # the reconnection time the stream asked for, if any


class SseLimitExceeded(SseError):
    """A line or message broke a limit. `dispatched`: messages completed before it in that chunk."""

    def __init__(self, reason: Reason, detail: str, dispatched: list[SseMessage]) -> None:
        super().__init__(reason, detail)
        self.dispatched = dispatched


# Building a frozen dataclass through __init__ goes through object.__setattr__
# once per field; writing the slots through their descriptors is the same
# result at a fraction of the cost, and this runs once per message.
_new_message = object.__new__
_set_event = SseMessage.event.__set__  # type: ignore[attr-defined]
_set_data = SseMessage.data.__set__  # type: ignore[attr-defined]
_set_id = SseMessage.last_event_id.__set__  # type: ignore[attr-defined]
_set_retry = SseMessage.retry.__set__  # type: ignore[attr-defined]


class SseDecoder:
    __slots__ = (
        "max_line_bytes", "max_message_bytes",
        "_partial", "_skip_lf", "_bom_state", "_head",
        "_event", "_data", "_data_bytes", "_block_bytes", "_block_open",
        "_block_retry", "_last_id_text", "_retry",
        "_error", "_error_detail", "_closed",
        "messages", "comments", "bytes_fed",
    )

    def __init__(
        self,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_message_bytes = max_message_bytes
        self._partial = b""  # an incomplete line (no CR or LF yet), as raw bytes
        self._skip_lf = False  # the last chunk ended in CR: an LF first in the next chunk is its pair
        self._bom_state = 0  # 0: start not yet seen; 1: done
        self._head = b""  # first bytes held back until they prove to be a BOM or not
        self._event = b""
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._block_bytes = 0  # raw bytes of the pending message's lines, for diagnostics
        self._block_open = False  # a field line arrived since the last blank line
        self._block_retry: int | None = None
        self._last_id_text = ""
        self._retry: int | None = None
        self._error: Reason | None = None
        self._error_detail = ""
        self._closed = False
        self.messages = 0
        self.comments = 0
        self.bytes_fed = 0

    @property
    def failed(self) -> Reason | None:
        return self._error

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) most recently set by a valid retry field."""
        return self._retry

    @property
    def last_event_id(self) -> str:
        return self._last_id_text

    def feed(self, data: bytes) -> list[SseMessage]:
        if self._error is not None:
            raise SseLimitExceeded(self._error, self._error_detail, [])
        if self._closed:
            raise RuntimeError("feed() after close()")
        if not data:
            return []
        self.bytes_fed += len(data)
        if self._bom_state == 0:
            data = self._strip_bom(data)
            if not data:
                return []
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == 0x0A:
                data = data[1:]
                if not data:
                    return []
        if b"\r" in data:
            # a CR ending this chunk is a complete line end; remember to swallow its LF
            self._skip_lf = data[-1] == 0x0D
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if self._partial:
            data = self._partial + data
        lines = data.split(b"\n")
        partial = lines.pop()
        if len(data) > self.max_line_bytes:
            too_long = self._first_long_line(lines)
            if too_long is not None or len(partial) > self.max_line_bytes:
                return self._fail_line(lines, too_long)
        self._partial = partial
        out = self._lines(lines) if lines else []
        if self._data_bytes > self.max_message_bytes:
            self._fail(Reason.SSE_MESSAGE_TOO_LARGE, f"data buffer over {self.max_message_bytes} bytes")
            raise SseLimitExceeded(self._error, self._error_detail, out)  # type: ignore[arg-type]
        return out

    def close(self) -> EndOfStream:
        """End of stream: discard and report any unterminated message. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._bom_state == 0 and self._head:
                self._partial = self._head  # a stream shorter than a BOM: just a partial line
                self._head = b""
        pending = self._block_bytes + len(self._partial)
        return EndOfStream(
            incomplete=bool(self._partial) or self._block_open,
            pending_bytes=pending,
            messages=self.messages,
            comments=self.comments,
            bytes_fed=self.bytes_fed,
            error=self._error,
            last_event_id=self._last_id_text,
            retry=self._retry,
        )

    # -- internals ---------------------------------------------------------

    def _strip_bom(self, data: bytes) -> bytes:
        head = self._head + data
        if len(head) < 3 and _BOM.startswith(head):
            self._head = head  # could still become a BOM
            return b""
        self._bom_state = 1
        self._head = b""
        return head[3:] if head.startswith(_BOM) else head

    def _first_long_line(self, lines: list[bytes]) -> int | None:
        limit = self.max_line_bytes
        if max(map(len, lines), default=0) <= limit:
            return None
        return next(i for i, line in enumerate(lines) if len(line) > limit)

    def _fail(self, reason: Reason, detail: str) -> None:
        self._error = reason
        self._error_detail = detail
        self._partial = b""

    def _fail_line(self, lines: list[bytes], too_long: int | None) -> list[SseMessage]:
        before = lines if too_long is None else lines[:too_long]
        out = self._lines(before) if before else []
        if self._error is None and self._data_bytes > self.max_message_bytes:
            self._fail(Reason.SSE_MESSAGE_TOO_LARGE, f"data buffer over {self.max_message_bytes} bytes")
        elif self._error is None:
            self._fail(Reason.SSE_LINE_TOO_LONG, f"line over {self.max_line_bytes} bytes")
        raise SseLimitExceeded(self._error, self._error_detail, out)  # type: ignore[arg-type]

    def _lines(self, lines: list[bytes]) -> list[SseMessage]:
        """Apply complete lines (without their line ends) and return the dispatched messages."""
        out: list[SseMessage] = []
        append_out = out.append
        event = self._event
        data = self._data
        data_bytes = self._data_bytes
        block_bytes = self._block_bytes
        block_open = self._block_open
        block_retry = self._block_retry
        comments = 0
        limit = self.max_message_bytes
        for line in lines:
            if not line:
                # blank line: dispatch
                if data:
                    if data_bytes > limit:
                        break  # reported by the caller via _data_bytes
                    if len(data) == 1:
                        text = data[0].decode("utf-8", "replace")
                    else:
                        text = b"\n".join(data).decode("utf-8", "replace")
                    message = _new_message(SseMessage)
                    _set_event(message, event.decode("utf-8", "replace") if event else "message")
                    _set_data(message, text)
                    _set_id(message, self._last_id_text)
                    _set_retry(message, block_retry)
                    append_out(message)
                    data = []
                    data_bytes = 0
                event = b""
                block_retry = None
                block_bytes = 0
                block_open = False
                continue
            if line[0] == 0x3A:  # ':'
                comments += 1
                continue
            block_open = True
            block_bytes += len(line) + 1
            if line.startswith(b"data"):
                # the common case first: "data: value" or "data:value"
                if line[4:6] == b": ":
                    value = line[6:]
                    data.append(value)
                    data_bytes += len(value) + 1
                    continue
                if line[4:5] == b":":
                    value = line[5:]
                    data.append(value)
                    data_bytes += len(value) + 1
                    continue
            colon = line.find(b":")
            if colon < 0:
                name = line
                value = b""
            else:
                name = line[:colon]
                value = line[colon + 2:] if line[colon + 1:colon + 2] == b" " else line[colon + 1:]
            if name == b"event":
                event = value
            elif name == b"data":
                data.append(value)
                data_bytes += len(value) + 1
            elif name == b"id":
                if b"\x00" not in value:
                    self._last_id_text = value.decode("utf-8", "replace")
            elif name == b"retry":
                if value.isdigit():  # bytes.isdigit is ASCII-only, as the spec wants
                    block_retry = self._retry = int(value)
            # any other field is ignored, per spec
        else:
            self._event = event
            self._data = data
            self._data_bytes = data_bytes
            self._block_bytes = block_bytes
            self._block_open = block_open
            self._block_retry = block_retry
            self.comments += comments
            self.messages += len(out)
            return out
        # broke out: a message over the limit reached its blank line
        self._data_bytes = data_bytes
        self._block_bytes = block_bytes
        self._block_open = block_open
        self.comments += comments
        self.messages += len(out)
        return out
