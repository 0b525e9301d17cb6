"""Shared helpers for the executor's broker tests: signed calls, topic reads, execution counting."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from callgate import avro
from callgate.kafka import make_producer, read_topic
from callgate.records import ApprovedCall
from callgate.signing import canonical_json, sign
from callgate.topics import TopicNames

KEY_ID = "test-k1"
KEY = bytes.fromhex("11" * 32)
KEYS = {KEY_ID: KEY}
APPEND_MARKER = str(Path(__file__).with_name("append_marker.py"))


def approved_call(
    *, run_id: str, tool: str, args: dict, workspace: Path | str, call_id: str | None = None, key: bytes = KEY
) -> ApprovedCall:
    call = ApprovedCall(
        call_id=call_id or f"call-{uuid.uuid4().hex}",
        run_id=run_id,
        attempt_id=f"{run_id}-a0",
        response_id=f"{run_id}-resp",
        item_id=f"item-{uuid.uuid4().hex[:8]}",
        tool_name=tool,
        arguments=canonical_json(args),
        policy_id="test",
        policy_version="1",
        workspace=str(workspace),
        route="test",
        approved_at=int(time.time() * 1000),
        approved_by="policy",
        key_id=KEY_ID,
        signature="",
    )
    return sign(call, key)


async def publish(bootstrap: str, topic: str, calls: list[ApprovedCall]) -> None:
    producer = await make_producer(bootstrap)
    try:
        for call in calls:
            await producer.send_and_wait(topic, avro.encode(call), key=call.run_id.encode())
    finally:
        await producer.stop()


async def decoded(bootstrap: str, topic: str, until: Callable[[list], bool] | None = None, timeout_s: float = 60.0):
    if until is None:
        records = await read_topic(bootstrap, topic)
    else:
        records = await read_topic(
            bootstrap, topic, until=lambda rs: until([avro.decode(r.value) for r in rs]), timeout_s=timeout_s
        )
    return [avro.decode(r.value) for r in records]


def final_ledger(entries: list) -> dict:
    out: dict = {}
    for entry in entries:
        if out.get(entry.call_id) is None or out[entry.call_id].phase == "STARTED":
            out[entry.call_id] = entry
    return out


def markers(path: Path) -> Counter:
    """How many times each call appended its marker (run_command side effects)."""
    if not path.exists():
        return Counter()
    return Counter(line for line in path.read_text().splitlines() if line)


class RenameCounter:
    """Counts renames onto each name in one directory with inotify(7) (IN_MOVED_TO).

    write_file ends every execution with exactly one rename of its temp file onto
    the target, so this counts real executions, from outside the executor.
    """

    IN_MOVED_TO = 0x00000080
    IN_NONBLOCK = os.O_NONBLOCK
    IN_Q_OVERFLOW = 0x00004000

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = libc.inotify_init1(self.IN_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, os.fsencode(directory), self.IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        self.counts: Counter = Counter()
        self.overflowed = False

    def drain(self) -> Counter:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return self.counts
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return self.counts
                raise
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                offset += 16 + length
                if mask & self.IN_Q_OVERFLOW:
                    self.overflowed = True
                elif mask & self.IN_MOVED_TO:
                    self.counts[name] += 1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


async def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


def topics_env(bootstrap: str, topics: TopicNames) -> dict[str, str]:
    return {
        "CALLGATE_KAFKA_BOOTSTRAP": bootstrap,
        "CALLGATE_TOPIC_NAMESPACE": topics.namespace,
        "CALLGATE_SIGNING_KEYS": f"{KEY_ID}:{KEY.hex()}",
        "CALLGATE_SIGNING_KEY_ID": KEY_ID,
        "CALLGATE_POLICIES_DIR": "/nonexistent-callgate-policies",
    }
