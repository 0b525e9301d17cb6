from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ingest.upstream import LocalUpstream

STREAM = b"event: a\ndata: 1\n\nevent: b\ndata: 2\n\n"


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[LocalUpstream]:
    (tmp_path / "route").mkdir()
    (tmp_path / "route" / "one.sse").write_bytes(STREAM)
    (tmp_path / "route" / "two.sse").write_bytes(b"data: second\n\n")
    (tmp_path.parent / "secret.sse").write_bytes(b"data: outside\n\n")
    async with LocalUpstream(tmp_path) as up:
        yield up


async def fetch(url: str, **kw: object) -> tuple[httpx.Response, list[bytes]]:
    async with httpx.AsyncClient(timeout=kw.pop("timeout", 5.0)) as client:  # type: ignore[arg-type]
        async with client.stream("POST", url, content=b'{"stream":true}') as response:
            chunks = [chunk async for chunk in response.aiter_raw()]
            return response, chunks


async def test_serves_the_file_as_event_stream(upstream: LocalUpstream) -> None:
    response, chunks = await fetch(upstream.url("route/one.sse"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert b"".join(chunks) == STREAM
    assert upstream.requests[0].body_bytes == len(b'{"stream":true}')
    assert upstream.requests[0].method == "POST"


async def test_chunk_size_and_delay(upstream: LocalUpstream) -> None:
    response, chunks = await fetch(upstream.url("route/one.sse", chunk=1, delay_ms=1))
    assert b"".join(chunks) == STREAM
    assert len(chunks) > 1  # a one-byte writer is visible to the reader as many reads


async def test_cut_mid_message_breaks_the_body(upstream: LocalUpstream) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        await fetch(upstream.url("route/one.sse", cut_after=12))


async def test_stall_keeps_the_connection_open(upstream: LocalUpstream) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await fetch(upstream.url("route/one.sse", stall_after=5), timeout=httpx.Timeout(5.0, read=0.3))


async def test_error_status_with_retry_after(upstream: LocalUpstream) -> None:
    response, _ = await fetch(upstream.url("route/one.sse", status=429, retry_after=2))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"


async def test_fail_first_then_succeed_per_key(upstream: LocalUpstream) -> None:
    url = upstream.url("route/one.sse", fail_first=2, status=503, key="run-1")
    statuses = [(await fetch(url))[0].status_code for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert [r.index for r in upstream.requests_for("run-1")] == [0, 1, 2]
    # another key has its own count
    assert (await fetch(upstream.url("route/one.sse", fail_first=1, key="run-2")))[0].status_code == 500


async def test_attempt_files_and_fault_attempts(upstream: LocalUpstream) -> None:
    url = upstream.url("route/one.sse", attempts="route/one.sse,route/two.sse", cut_after=3,
                       fault_attempts=1, key="r")
    with pytest.raises(httpx.RemoteProtocolError):
        await fetch(url)
    _, chunks = await fetch(url)
    assert b"".join(chunks) == b"data: second\n\n"
    assert [r.served for r in upstream.requests_for("r")] == ["route/one.sse", "route/two.sse"]


async def test_no_path_outside_the_root(upstream: LocalUpstream) -> None:
    response, _ = await fetch(upstream.url("../secret.sse"))
    assert response.status_code == 404
    assert upstream._resolve("../secret.sse") is None  # httpx drops dot segments; check the server too
    assert upstream._resolve("route/../route/one.sse") is not None
    response, _ = await fetch(upstream.url("route/missing.sse"))
    assert response.status_code == 404


async def test_headers_are_recorded(upstream: LocalUpstream) -> None:
    async with httpx.AsyncClient() as client:
        await client.get(upstream.url("route/one.sse"), headers={"Authorization": "Bearer test-key"})
    assert upstream.requests[-1].headers["authorization"] == "Bearer test-key"


async def test_every_attempt_file_but_the_last_ends_as_a_disconnect(upstream: LocalUpstream) -> None:
    url = upstream.url("x", attempts="route/one.sse,route/two.sse", key="multi")
    with pytest.raises(httpx.RemoteProtocolError):
        await fetch(url)  # the whole first file arrives, then the connection drops
    for _ in range(2):  # the last file repeats, and ends cleanly
        response, chunks = await fetch(url)
        assert response.status_code == 200 and b"".join(chunks) == b"data: second\n\n"
    assert [r.served for r in upstream.requests_for("multi")] == ["route/one.sse", "route/two.sse", "route/two.sse"]


async def test_cut_is_exact_for_a_large_body(tmp_path: Path) -> None:
    big = b"".join(b"data: %06d\n\n" % i for i in range(40_000))  # ~560 KB, far past socket buffers
    (tmp_path / "big.sse").write_bytes(big)
    received = bytearray()
    async with LocalUpstream(tmp_path) as up, httpx.AsyncClient(timeout=10) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("GET", up.url("big.sse", cut_after=300_001)) as response:
                async for chunk in response.aiter_raw():
                    received += chunk
    assert bytes(received) == big[:300_001]


async def test_default_retry_after_and_json_error_body(upstream: LocalUpstream) -> None:
    async with httpx.AsyncClient() as client:
        limited = await client.post(upstream.url("route/one.sse", status=429))
        failed = await client.post(upstream.url("route/one.sse", status=500))
    assert limited.status_code == 429 and limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["status"] == 429
    assert failed.status_code == 500 and "retry-after" not in failed.headers


async def test_a_malformed_option_is_a_400(upstream: LocalUpstream) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.get(upstream.url("route/one.sse", chunk="lots"))
    assert response.status_code == 400
