"""Open paths inside a workspace without ever following a symlink.

The validator checked the path string; between that check and now a
directory may have been swapped for a symlink (CWE-367). So the executor does
not trust any resolved string: it walks from the workspace root one component
at a time with `dir_fd` + `O_NOFOLLOW`, which fails with ELOOP on a symlink,
and then acts on the file descriptors it holds ("open what you checked").
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager

from callgate.errors import ExecutionError, Reason

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FORBIDDEN_CHARS = ("\x00", "\\", ":")


def split_path(path: str, *, allow_root: bool = False) -> list[str]:
    """The components of a workspace-relative path, or SANDBOX_VIOLATION.

    A lexical re-check of what the validator already enforced; cheap, and it
    keeps the executor safe even if it is ever fed by something else.
    """
    if allow_root and path == ".":
        return []
    if not path or path.startswith("/") or any(c in path for c in _FORBIDDEN_CHARS):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "path form refused")
    if unicodedata.normalize("NFC", path) != path or unicodedata.normalize("NFKC", path) != path:
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "path not normalised")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or any(ord(ch) < 0x20 for ch in path):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "path segment refused")
    return parts


def open_root(workspace: str) -> int:
    """The workspace itself comes from the signed call (validator config), not the model."""
    if not os.path.isabs(workspace):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "workspace not absolute")
    try:
        return os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ExecutionError(Reason.SANDBOX_VIOLATION, f"workspace unavailable errno={exc.errno}") from exc


def _is_symlink(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_dir_beneath(root_fd: int, parts: list[str], *, create: bool = False) -> int:
    """Walk `parts` as directories below root_fd; return a new fd for the last one."""
    current = os.dup(root_fd)
    try:
        for name in parts:
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=current)
            except FileNotFoundError:
                if not create:
                    raise ExecutionError(Reason.TOOL_FAILED, "directory not found") from None
                try:
                    os.mkdir(name, 0o755, dir_fd=current)
                except FileExistsError:
                    pass  # raced with another creator; the NOFOLLOW open below decides
                nxt = _open_dir_component(name, current)
            except OSError as exc:
                nxt = _raise_for_component(exc, name, current)
            os.close(current)
            current = nxt
        return current
    except BaseException:
        os.close(current)
        raise


def _open_dir_component(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        return _raise_for_component(exc, name, dir_fd)


def _raise_for_component(exc: OSError, name: str, dir_fd: int) -> int:
    if exc.errno == errno.ELOOP or _is_symlink(name, dir_fd):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "symlink in path") from None
    if exc.errno == errno.ENOTDIR:
        raise ExecutionError(Reason.TOOL_FAILED, "not a directory") from None
    raise ExecutionError(Reason.TOOL_FAILED, f"open failed errno={exc.errno}") from None


@contextmanager
def parent_dir(workspace: str, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(fd of the verified parent directory, final component name)."""
    parts = split_path(path)
    root = open_root(workspace)
    try:
        parent = open_dir_beneath(root, parts[:-1], create=create)
    finally:
        os.close(root)
    try:
        yield parent, parts[-1]
    finally:
        os.close(parent)


@contextmanager
def directory(workspace: str, path: str) -> Iterator[int]:
    """fd of a verified directory ("." is the workspace root)."""
    parts = split_path(path, allow_root=True)
    root = open_root(workspace)
    try:
        fd = open_dir_beneath(root, parts)
    finally:
        os.close(root)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file_nofollow(name: str, dir_fd: int, flags: int = os.O_RDONLY) -> int:
    """Open a final component; a symlink there is a sandbox violation."""
    try:
        # O_NONBLOCK so a FIFO planted in the workspace cannot hang the open
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ExecutionError(Reason.TOOL_FAILED, "file not found") from None
    except OSError as exc:
        return _raise_for_component(exc, name, dir_fd)
