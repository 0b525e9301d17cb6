"""A local model API stand-in: a real HTTP/1.1 server on 127.0.0.1 that replays recorded SSE files.

Used by tests (``async with LocalUpstream(root) as up: up.base_url``) and by the
demo (``callgate upstream --fixtures DIR --port N``). It is built on asyncio
streams so it needs no dependency and can misbehave in exactly the ways a real
provider does, which a framework would try hard to prevent.

``GET|POST /<path relative to the fixtures root>?<options>`` streams the file as
``text/event-stream`` with chunked transfer encoding (so a cut connection is a
detectable protocol error, not a clean end). Options, all optional:

=================  ===================================================================
``chunk=N``        bytes per written chunk (default: the whole file in one write)
``delay_ms=F``     pause before each chunk after the first
``stall_after=N``  after N body bytes stop sending but keep the connection open
``cut_after=N``    after N body bytes drop the connection without ending the body
``fault_attempts`` apply stall/cut only to the first K requests of a key (default all)
``status=S``       answer S (e.g. 429, 500) instead of streaming
``fail_first=K``   answer ``status`` (default 500) to the first K requests of a key only
``retry_after=V``  the Retry-After header sent with an error status (429 and 503 send 1 when unset)
``attempts=a,b``   request i of a key serves file i (the last one repeats); the path is ignored.
                   Every file but the last is a failed attempt: it ends with the connection
                   dropped (no terminating chunk), so "disconnect, then a fresh attempt" replays
``key=K``          what requests are counted by (default: the path); use the run id
=================  ===================================================================

A malformed option is answered 400. Every request is recorded (path, key, index, method, headers) in ``requests``,
so a test can check, for example, that an API key header arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

_MAX_HEAD = 64 * 1024
_MAX_BODY = 8 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    key: str
    index: int  # 0 for the first request of this key
    headers: dict[str, str]  # lower-cased names
    body_bytes: int
    served: str  # fixture path served, or "" for an error answer


@dataclass(frozen=True, slots=True)
class StreamOptions:
    chunk: int = 0
    delay_ms: float = 0.0
    stall_after: int | None = None
    cut_after: int | None = None
    fault_attempts: int | None = None
    status: int | None = None
    fail_first: int | None = None
    retry_after: str | None = None
    attempts: tuple[str, ...] = ()
    key: str | None = None

    @classmethod
    def parse(cls, query: str) -> StreamOptions:
        raw = dict(parse_qsl(query, keep_blank_values=True))

        def integer(name: str) -> int | None:
            return int(raw[name]) if raw.get(name, "") != "" else None

        return cls(
            chunk=integer("chunk") or 0,
            delay_ms=float(raw.get("delay_ms") or 0),
            stall_after=integer("stall_after"),
            cut_after=integer("cut_after"),
            fault_attempts=integer("fault_attempts"),
            status=integer("status"),
            fail_first=integer("fail_first"),
            retry_after=raw.get("retry_after") or None,
            attempts=tuple(a for a in (raw.get("attempts") or "").split(",") if a),
            key=raw.get("key") or None,
        )


class _BadRequest(Exception):
    pass


@dataclass(slots=True)
class LocalUpstream:
    fixtures_root: Path
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[RecordedRequest] = field(default_factory=list)
    _counts: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    _server: asyncio.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items() if v is not None)
        return f"{self.base_url}/{path.lstrip('/')}" + (f"?{query}" if query else "")

    def requests_for(self, key: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.key == key]

    async def start(self) -> LocalUpstream:
        self.fixtures_root = Path(self.fixtures_root).resolve()
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            for task in list(self._handlers):
                with contextlib.suppress(BaseException):
                    await task
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def __aenter__(self) -> LocalUpstream:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- one connection, one request ---------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: nothing to answer
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target, headers, body_bytes = await self._read_request(reader)
        except _BadRequest:
            await self._answer(writer, 400, {"error": "bad request"})
            return
        split = urlsplit(target)
        path = unquote(split.path).lstrip("/")
        try:
            options = StreamOptions.parse(split.query)
        except ValueError:
            await self._answer(writer, 400, {"error": "bad option"})
            return
        key = options.key or path
        index = self._counts[key]
        self._counts[key] += 1
        failed_attempt = False
        if options.attempts:
            path = options.attempts[min(index, len(options.attempts) - 1)]
            failed_attempt = index < len(options.attempts) - 1

        def record(served: str) -> None:
            self.requests.append(RecordedRequest(method, path, key, index, headers, body_bytes, served))

        if method not in ("GET", "POST"):
            record("")
            await self._answer(writer, 405, {"error": "method not allowed"})
            return
        failing = options.status is not None or options.fail_first is not None
        if failing and (options.fail_first is None or index < options.fail_first):
            record("")
            status = options.status if options.status is not None else 500
            retry_after = options.retry_after or ("1" if status in (429, 503) else None)
            extra = {"Retry-After": retry_after} if retry_after else {}
            await self._answer(writer, status, {"error": {"type": "upstream_fault", "status": status}}, extra)
            return
        file = self._resolve(path)
        if file is None:
            record("")
            await self._answer(writer, 404, {"error": "no such fixture"})
            return
        record(path)
        faulty = options.fault_attempts is None or index < options.fault_attempts
        await self._stream(writer, reader, file.read_bytes(), options, faulty, drop_at_end=failed_attempt)

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], int]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
            raise _BadRequest from exc
        if len(head) > _MAX_HEAD:
            raise _BadRequest
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError as exc:
            raise _BadRequest from exc
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length") or 0)
        if length > _MAX_BODY:
            raise _BadRequest
        if length:
            await reader.readexactly(length)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            length = await self._drain_chunked(reader)
        return method, target, headers, length

    @staticmethod
    async def _drain_chunked(reader: asyncio.StreamReader) -> int:
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return total
            total += size
            if total > _MAX_BODY:
                raise _BadRequest
            await reader.readexactly(size + 2)

    def _resolve(self, path: str) -> Path | None:
        candidate = (self.fixtures_root / path).resolve()
        if not candidate.is_relative_to(self.fixtures_root) or not candidate.is_file():
            return None
        return candidate

    @staticmethod
    async def _answer(
        writer: asyncio.StreamWriter, status: int, body: object, extra: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(body).encode()
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in (extra or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()

    @staticmethod
    async def _stream(
        writer: asyncio.StreamWriter, reader: asyncio.StreamReader, body: bytes, options: StreamOptions, faulty: bool,
        *, drop_at_end: bool = False,
    ) -> None:
        # drain() returns only once the kernel has every byte, so a cut or a stall happens exactly
        # at the byte offset asked for, not wherever the transport buffer happened to be
        writer.transport.set_write_buffer_limits(high=0)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        await writer.drain()
        limit = len(body)
        stall = options.stall_after if faulty else None
        cut = options.cut_after if faulty else None
        if stall is not None:
            limit = min(limit, stall)
        if cut is not None:
            limit = min(limit, cut)
        size = options.chunk if options.chunk > 0 else max(limit, 1)
        sent = 0
        while sent < limit:
            if sent and options.delay_ms:
                await asyncio.sleep(options.delay_ms / 1000)
            piece = body[sent:min(sent + size, limit)]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            sent += len(piece)
        if cut is not None and cut < len(body) and (stall is None or cut <= stall):
            writer.transport.abort()  # no terminating chunk: the client sees a broken body
            return
        if stall is not None and stall < len(body):
            await reader.read()  # hold the connection open until the client gives up (or we stop)
            return
        if drop_at_end:
            writer.transport.abort()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()
