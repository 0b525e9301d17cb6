"""read_file, write_file and list_dir, confined to the workspace by fd walking."""

from __future__ import annotations

import json
import os
import secrets
import stat
from typing import Any

from callgate.errors import ExecutionError, Reason
from callgate.states import ItemState
from executor.tools.base import ToolContext, ToolOutcome, cap
from executor.tools.confine import directory, open_file_nofollow, parent_dir

_READ_CHUNK = 64 * 1024


def _read_regular(fd: int, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes of an open regular file, and its size."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ExecutionError(Reason.TOOL_FAILED, "not a regular file")
    os.set_blocking(fd, True)
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, min(_READ_CHUNK, remaining))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks), info.st_size


def read_file(args: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    limit = min(int(args.get("max_bytes", ctx.limits.read_max_bytes)), ctx.limits.read_max_bytes)
    with parent_dir(ctx.workspace, args["path"]) as (parent, name):
        fd = open_file_nofollow(name, parent)
        try:
            data, size = _read_regular(fd, limit)
        finally:
            os.close(fd)
    kept, total, truncated = cap(data, limit, max(size, len(data)))
    return ToolOutcome(ItemState.EXECUTED, kept, total, truncated)


def read_for_digest(workspace: str, path: str, limit: int) -> bytes | None:
    """The whole current content of a workspace file, or None if it is absent or too large."""
    try:
        with parent_dir(workspace, path) as (parent, name):
            fd = open_file_nofollow(name, parent)
            try:
                data, size = _read_regular(fd, limit + 1)
            finally:
                os.close(fd)
    except ExecutionError:
        return None
    return data if size <= limit and len(data) <= limit else None


def write_file(args: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    content = args["content"].encode("utf-8")
    with parent_dir(ctx.workspace, args["path"], create=bool(args.get("create_dirs", False))) as (
        parent,
        name,
    ):
        mode = _existing_target_mode(name, parent)
        # The temp file lives in the verified directory, so the rename stays inside it.
        tmp = f".{name[:64]}.{secrets.token_hex(8)}.callgate-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        try:
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            # rename never follows a symlink at the destination: it replaces the name itself.
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=parent)
            except OSError:
                pass
            raise
        os.fsync(parent)
    summary = json.dumps({"bytes_written": len(content)}).encode()
    return ToolOutcome(ItemState.EXECUTED, summary, len(summary), False)


def _existing_target_mode(name: str, parent: int) -> int:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return 0o644
    if stat.S_ISLNK(info.st_mode):
        # The validator treats a symlink's target as the write; here the link itself is refused.
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "target is a symlink")
    if not stat.S_ISREG(info.st_mode):
        raise ExecutionError(Reason.TOOL_FAILED, "target is not a regular file")
    return stat.S_IMODE(info.st_mode)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def list_dir(args: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    with directory(ctx.workspace, args["path"]) as fd:
        names = sorted(os.listdir(fd))
        limit = ctx.limits.list_max_entries
        entries = []
        for entry_name in names[:limit]:
            try:
                info = os.stat(entry_name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while listing
            item: dict[str, Any] = {"name": entry_name, "type": _kind(info.st_mode)}
            if stat.S_ISREG(info.st_mode):
                item["size"] = info.st_size
            entries.append(item)
    body = json.dumps(
        {"entries": entries, "total": len(names), "truncated": len(names) > limit},
        ensure_ascii=True,  # non-UTF-8 names survive as escapes, never as invalid bytes
    ).encode("ascii")
    kept, total, truncated = cap(body, ctx.limits.output_max_bytes)
    return ToolOutcome(ItemState.EXECUTED, kept, total, truncated or len(names) > limit)
