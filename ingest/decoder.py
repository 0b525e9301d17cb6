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

import re
from collections import deque
from dataclasses import dataclass
from itertools import repeat

from callgate.errors import Reason, SseError

DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"
_EVENT_NAME_CACHE = 256
# after the bulk path fails to tile a region, this many feeds use the general path
# directly, so a stream full of comments or ids does not pay for both
_TILING_BACKOFF = 16
_TILE = re.compile(r"(?:event: ([^\n]*+)\n)?data: ([^\n]*+)\n\n")
_TILE_CRLF = re.compile(r"(?:event: ([^\r]*+)\r\n)?data: ([^\r]*+)\r\n\r\n")
_DEFAULT_EVENT = {"": "message"}
_drain = deque


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
        "messages", "comments", "bytes_fed", "_event_names", "_tiling_backoff",
    )

    def __init__(
        self,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_message_bytes = max_message_bytes
        # bytes after the last dispatch not yet applied, CRs already normalised: an incomplete
        # line, or (on the bulk path) whole lines of a message whose blank line has not come
        self._partial = b""
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
        self._event_names: dict[bytes, str] = {}
        self._tiling_backoff = 0  # feeds to skip the bulk path after it did not apply

    @property
    def failed(self) -> Reason | None:
        return self._error

    # The counters and these two properties are exact at every dispatch and after close();
    # between them, lines of an unfinished message may not have been applied yet.

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
        if self._partial:
            # raw bytes from a line start; joining first keeps a CR LF split across chunks whole
            data = self._partial + data
            self._partial = b""
        if len(data) > self.max_line_bytes or self._data_bytes + len(data) > self.max_message_bytes:
            return self._feed_checked(self._normalise(data))
        if self._tiling_backoff or self._block_open:
            if self._tiling_backoff:
                self._tiling_backoff -= 1
            return self._feed_general(self._normalise(data))
        crlf = b"\r" in data
        blank = b"\r\n\r\n" if crlf else b"\n\n"
        end = data.rfind(blank)
        if end < 0:
            if crlf:
                return self._feed_general(self._normalise(data))  # blank lines may be CR CR, LF LF...
            # no blank line, so nothing can dispatch: keep the bytes unparsed until one arrives
            self._partial = data
            return []
        end += len(blank)
        tiled = self._tiled(data[:end], crlf)
        if tiled is None:
            self._tiling_backoff = _TILING_BACKOFF
            return self._feed_blocks(self._normalise(data))
        rest = data[end:]
        if crlf and rest and b"\n\n" in rest.replace(b"\r\n", b"\n").replace(b"\r", b"\n"):
            # after the last CRLF CRLF a blank line of another kind (CR CR, LF LF) may follow
            tiled.extend(self._feed_general(self._normalise(rest)))
            return tiled
        # the rest starts a message at a line start; it is parsed once its blank line arrives
        self._partial = rest
        return tiled

    def _feed_general(self, data: bytes) -> list[SseMessage]:
        """Normalised data on the general path, handing back to the bulk path where it can."""
        out: list[SseMessage] = []
        if self._block_open:
            # fields from earlier chunks were parsed line by line: finish that message the same way
            cut = data.find(b"\n\n")
            if cut < 0 or self._tiling_backoff:
                return self._feed_blocks(data)
            cut += 2
            out = self._feed_blocks(data[:cut])
            data = data[cut:]
        end = data.rfind(b"\n\n")
        if end < 0:
            self._partial = data
            return out
        end += 2
        tiled = self._tiled(data[:end], False)
        if tiled is None:
            self._tiling_backoff = _TILING_BACKOFF
            out.extend(self._feed_blocks(data))
            return out
        out.extend(tiled)
        self._partial = data[end:]
        return out

    def close(self) -> EndOfStream:
        """End of stream: discard and report any unterminated message. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._bom_state == 0 and self._head:
                self._partial = self._head  # a stream shorter than a BOM: just a partial line
                self._head = b""
            if self._partial and self._error is None:
                # complete lines kept unparsed by the bulk path: apply them, they hold no blank
                # line that could dispatch, so this only settles fields, comments and the tail
                lines = self._normalise(self._partial).split(b"\n")
                self._partial = lines.pop()
                self._lines(lines)
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

    def _normalise(self, data: bytes) -> bytes:
        """CRLF and lone CR become LF: two C passes, after which only LF needs handling."""
        if b"\r" not in data:
            return data
        # a CR ending the chunk is a complete line end; remember to swallow its LF
        self._skip_lf = data[-1] == 0x0D
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _tiled(self, region: bytes, crlf: bool) -> list[SseMessage] | None:
        """The hottest path: a region made only of `[event: X] data: Y` messages, in bulk.

        `region` starts at a line start with no fields pending and ends with a
        blank line. It is decoded at once (it ends at a line end, so this is the
        same text per-line decoding gives). The messages are found by findall;
        they are accepted only if they tile the region: non-overlapping matches
        whose lengths add up to the region's length cover all of it, so no
        character was skipped and the general rules give exactly these messages.
        Anything else (comments, id, retry, several data lines, no space after
        a colon) returns None and the caller takes the general path. Objects
        are built with C-level map passes: that is the per-message cost left.
        """
        text = region.decode("utf-8", "replace")
        if crlf:
            # CRLF text is matched as is (normalising first costs two more passes); values stop
            # at CR, and the LF count below proves that no value hides a lone LF
            found = _TILE_CRLF.findall(text)
            event_extra, data_extra = 9, 10  # len("event: \r\n"), len("data: \r\n\r\n")
        else:
            found = _TILE.findall(text)
            event_extra, data_extra = 8, 8  # len("event: \n"), len("data: \n\n")
        if not found:
            return None
        n = len(found)
        events, datas = zip(*found)
        # an empty event group is either no event line or "event:" with an empty value; both
        # mean "message", and counting it as absent can only undercount: never a false tiling
        named = n - events.count("")
        covered = sum(map(len, events)) + sum(map(len, datas)) + data_extra * n + event_extra * named
        if covered != len(text):
            return None
        if crlf and text.count("\n") != 2 * n + named:
            return None
        messages = list(map(_new_message, repeat(SseMessage, n)))
        _drain(map(_set_event, messages, map(_DEFAULT_EVENT.get, events, events)), 0)
        _drain(map(_set_data, messages, datas), 0)
        _drain(map(_set_id, messages, repeat(self._last_id_text, n)), 0)
        _drain(map(_set_retry, messages, repeat(None, n)), 0)
        self.messages += n
        return messages

    def _feed_checked(self, data: bytes) -> list[SseMessage]:
        """Line by line with limit checks: used when this buffer could break a limit."""
        lines = data.split(b"\n")
        partial = lines.pop()
        too_long = self._first_long_line(lines)
        if too_long is not None or len(partial) > self.max_line_bytes:
            return self._fail_line(lines, too_long)
        self._partial = partial
        out = self._lines(lines) if lines else []
        if self._data_bytes > self.max_message_bytes:
            self._fail(Reason.SSE_MESSAGE_TOO_LARGE, f"data buffer over {self.max_message_bytes} bytes")
            raise SseLimitExceeded(self._error, self._error_detail, out)  # type: ignore[arg-type]
        return out

    def _feed_blocks(self, data: bytes) -> list[SseMessage]:
        """The hot path, for a buffer too small to break a limit.

        Splitting at LF LF yields one block per message. Nearly every block in
        practice is `event: X` LF `data: Y` or just `data: Y`; those are
        dispatched directly, which matches the line-by-line rules exactly for
        that shape. Any other block (comments, ids, retry, several data lines,
        no space after the colon, extra blank lines) goes through `_lines`.
        """
        blocks = data.split(b"\n\n")
        tail = blocks.pop()
        out: list[SseMessage] = []
        if blocks:
            start = 0
            if self._block_open:
                # the first block continues fields that arrived in earlier chunks
                out = self._lines(blocks[0].split(b"\n") + [b""])
                start = 1
            append = out.append
            names = self._event_names
            last_id = self._last_id_text
            dispatched = 0
            for i in range(start, len(blocks)):
                block = blocks[i]
                if block.startswith(b"event: "):
                    nl = block.find(b"\n")
                    if nl > 0 and block.startswith(b"data: ", nl + 1) and block.find(b"\n", nl + 1) < 0:
                        raw_event = block[7:nl]
                        event = names.get(raw_event)
                        if event is None:
                            event = self._event_name(raw_event)
                        text = block[nl + 7:].decode("utf-8", "replace")
                    else:
                        out.extend(self._lines(block.split(b"\n") + [b""]))
                        last_id = self._last_id_text
                        continue
                elif block.startswith(b"data: ") and block.find(b"\n") < 0:
                    event = "message"
                    text = block[6:].decode("utf-8", "replace")
                else:
                    out.extend(self._lines(block.split(b"\n") + [b""]))
                    last_id = self._last_id_text
                    continue
                message = _new_message(SseMessage)
                _set_event(message, event)
                _set_data(message, text)
                _set_id(message, last_id)
                _set_retry(message, None)
                append(message)
                dispatched += 1
            self.messages += dispatched
        lines = tail.split(b"\n")
        self._partial = lines.pop()
        if lines:
            out.extend(self._lines(lines))
        return out

    def _event_name(self, raw: bytes) -> str:
        name = raw.decode("utf-8", "replace") if raw else "message"
        if len(self._event_names) < _EVENT_NAME_CACHE:  # bounded: a hostile stream may invent names
            self._event_names[raw] = name
        return name

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
