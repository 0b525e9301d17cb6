"""Built-in tools against real temp directories, real subprocesses and a real HTTP server."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from callgate.errors import Reason
from callgate.signing import canonical_json
from callgate.states import ItemState
from executor.tools import Limits, ToolContext, run_tool
from executor.tools import confine, files


def call(tool: str, args: dict, ws: Path, **ctx_kw):
    return run_tool(tool, canonical_json(args), ToolContext(str(ws), **ctx_kw))


@pytest.fixture()
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_text("hello")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET")
    return root


# --- read_file ----------------------------------------------------------------


def test_read_file_inside(ws: Path) -> None:
    out = call("read_file", {"path": "src/a.txt"}, ws)
    assert (out.state, out.output, out.output_bytes, out.truncated) == (ItemState.EXECUTED, b"hello", 5, False)


def test_read_file_size_cap(ws: Path) -> None:
    (ws / "big").write_bytes(b"x" * 5000)
    out = call("read_file", {"path": "big", "max_bytes": 100}, ws)
    assert out.output == b"x" * 100 and out.output_bytes == 5000 and out.truncated
    capped = call("read_file", {"path": "big"}, ws, limits=Limits(read_max_bytes=10))
    assert len(capped.output) == 10 and capped.truncated


@pytest.mark.parametrize("path", ["../outside/secret.txt", "/etc/passwd", "src/../../outside/secret.txt",
                                  "src//a.txt", "./src/a.txt", "src\\a.txt", "a\x00b", "ｓrc/a.txt", "C:x"])
def test_read_file_refuses_path_forms(ws: Path, path: str) -> None:
    out = call("read_file", {"path": path}, ws)
    assert out.state is ItemState.FAILED and out.error_class == Reason.SANDBOX_VIOLATION.value


def test_read_file_symlink_escape(ws: Path) -> None:
    os.symlink(ws.parent / "outside" / "secret.txt", ws / "link.txt")
    os.symlink(ws.parent / "outside", ws / "linkdir")
    for path in ("link.txt", "linkdir/secret.txt"):
        out = call("read_file", {"path": path}, ws)
        assert out.state is ItemState.FAILED and out.error_class == Reason.SANDBOX_VIOLATION.value
        assert b"SECRET" not in out.output


def test_read_file_symlink_inside_workspace_also_refused(ws: Path) -> None:
    # even a link that stays inside is refused: the executor acts on no resolved strings
    os.symlink("a.txt", ws / "src" / "alias.txt")
    out = call("read_file", {"path": "src/alias.txt"}, ws)
    assert out.error_class == Reason.SANDBOX_VIOLATION.value


def test_read_file_fifo_does_not_hang(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    out = call("read_file", {"path": "pipe"}, ws)
    assert out.state is ItemState.FAILED and out.error_class == Reason.TOOL_FAILED.value


def test_toctou_directory_swapped_for_symlink_after_validation(ws: Path) -> None:
    """The validator saw a real directory; by execution time it is a symlink out."""
    (ws / "data").mkdir()
    (ws / "data" / "secret.txt").write_text("fine")
    assert call("read_file", {"path": "data/secret.txt"}, ws).output == b"fine"  # "validated"
    (ws / "data" / "secret.txt").unlink()
    (ws / "data").rmdir()
    os.symlink(ws.parent / "outside", ws / "data")  # swapped in
    read = call("read_file", {"path": "data/secret.txt"}, ws)
    write = call("write_file", {"path": "data/secret.txt", "content": "pwned"}, ws)
    assert read.error_class == write.error_class == Reason.SANDBOX_VIOLATION.value
    assert (ws.parent / "outside" / "secret.txt").read_text() == "SECRET"


def test_toctou_swap_while_walking(ws: Path) -> None:
    """Swap the parent for a symlink between opening the parent fd and the final open:
    the held fd still names the verified directory, so nothing outside is touched."""
    (ws / "d").mkdir()
    root = confine.open_root(str(ws))
    parent = confine.open_dir_beneath(root, ["d"])
    os.close(root)
    try:
        os.rename(ws / "d", ws / "d-moved")
        os.symlink(ws.parent / "outside", ws / "d")
        fd = os.open("new.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=parent)
        os.close(fd)
    finally:
        os.close(parent)
    assert (ws / "d-moved" / "new.txt").exists()
    assert not (ws.parent / "outside" / "new.txt").exists()


# --- write_file ---------------------------------------------------------------


def test_write_file_atomic_replace_keeps_no_temp(ws: Path) -> None:
    target = ws / "src" / "a.txt"
    before = os.stat(target).st_ino
    out = call("write_file", {"path": "src/a.txt", "content": "new ✓"}, ws)
    assert out.state is ItemState.EXECUTED
    assert target.read_text() == "new ✓"
    assert os.stat(target).st_ino != before  # replaced by rename, not rewritten in place
    assert json.loads(out.output) == {"bytes_written": len("new ✓".encode())}
    assert sorted(p.name for p in (ws / "src").iterdir()) == ["a.txt"]


def test_write_file_reader_never_sees_partial_content(ws: Path) -> None:
    target = ws / "f.txt"
    old, new = "A" * 200_000, "B" * 200_000
    target.write_text(old)
    seen: set[str] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.add(target.read_text())

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(20):
            call("write_file", {"path": "f.txt", "content": new if i % 2 == 0 else old}, ws)
    finally:
        stop.set()
        t.join()
    assert seen <= {old, new} and seen


def test_write_file_create_dirs_only_when_asked(ws: Path) -> None:
    no = call("write_file", {"path": "x/y/z.txt", "content": "1"}, ws)
    assert no.state is ItemState.FAILED and not (ws / "x").exists()
    yes = call("write_file", {"path": "x/y/z.txt", "content": "1", "create_dirs": True}, ws)
    assert yes.state is ItemState.EXECUTED and (ws / "x" / "y" / "z.txt").read_text() == "1"


def test_write_file_refuses_symlink_target_and_parent(ws: Path) -> None:
    os.symlink(ws.parent / "outside" / "secret.txt", ws / "link.txt")
    os.symlink(ws.parent / "outside", ws / "out")
    for path in ("link.txt", "out/secret.txt", "out/new.txt", "../outside/secret.txt"):
        out = call("write_file", {"path": path, "content": "pwned", "create_dirs": True}, ws)
        assert out.error_class == Reason.SANDBOX_VIOLATION.value, path
    assert (ws.parent / "outside" / "secret.txt").read_text() == "SECRET"
    assert not (ws.parent / "outside" / "new.txt").exists()


def test_write_file_create_dirs_never_through_symlink(ws: Path) -> None:
    os.symlink(ws.parent / "outside", ws / "out")
    out = call("write_file", {"path": "out/deeper/new.txt", "content": "x", "create_dirs": True}, ws)
    assert out.error_class == Reason.SANDBOX_VIOLATION.value
    assert not (ws.parent / "outside" / "deeper").exists()


# --- list_dir -----------------------------------------------------------------


def test_list_dir(ws: Path) -> None:
    os.symlink("nowhere", ws / "dangling")
    out = call("list_dir", {"path": "."}, ws)
    listing = json.loads(out.output)
    assert listing["entries"] == [
        {"name": "dangling", "type": "symlink"},
        {"name": "src", "type": "dir"},
    ]
    sub = json.loads(call("list_dir", {"path": "src"}, ws).output)
    assert sub["entries"] == [{"name": "a.txt", "type": "file", "size": 5}]


def test_list_dir_cap_and_escape(ws: Path) -> None:
    for i in range(30):
        (ws / f"f{i:02}").write_text("")
    out = call("list_dir", {"path": "."}, ws, limits=Limits(list_max_entries=10))
    listing = json.loads(out.output)
    assert len(listing["entries"]) == 10 and listing["total"] == 31 and out.truncated
    os.symlink(ws.parent / "outside", ws / "out")
    assert call("list_dir", {"path": "out"}, ws).error_class == Reason.SANDBOX_VIOLATION.value


# --- run_command ----------------------------------------------------------------


def test_run_command_argv_is_literal_and_cwd_confined(ws: Path) -> None:
    out = call("run_command", {"argv": ["echo", "$(id); `id` | cat"], "cwd": "src"}, ws)
    assert out.state is ItemState.EXECUTED and out.exit_code == 0
    assert out.output == b"$(id); `id` | cat\n"
    pwd = call("run_command", {"argv": ["pwd"], "cwd": "src"}, ws)
    assert pwd.output.decode().strip() == os.path.realpath(ws / "src")


def test_run_command_cwd_symlink_refused(ws: Path) -> None:
    os.symlink(ws.parent / "outside", ws / "out")
    out = call("run_command", {"argv": ["ls"], "cwd": "out"}, ws)
    assert out.error_class == Reason.SANDBOX_VIOLATION.value


def test_run_command_env_scrubbed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CALLGATE_SIGNING_KEYS", "k1:" + "ab" * 32)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak-me")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    out = call("run_command", {"argv": ["env"]}, ws)
    env = dict(line.split("=", 1) for line in out.output.decode().splitlines())
    assert "CALLGATE_SIGNING_KEYS" not in env and "AWS_SECRET_ACCESS_KEY" not in env and "LD_PRELOAD" not in env
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["GIT_CONFIG_NOSYSTEM"] == "1"
    assert env["HOME"].startswith("/") and env["HOME"] != os.environ.get("HOME")
    assert not os.path.exists(env["HOME"])  # the isolated home is removed afterwards


@pytest.mark.parametrize("name", ["LD_PRELOAD", "GIT_SSH_COMMAND", "PYTHONPATH", "BASH_ENV", "PATH", "IFS",
                                  "NODE_OPTIONS", "AWS_SECRET_ACCESS_KEY", "MY_TOKEN", "lower"])
def test_run_command_model_env_denied(ws: Path, name: str) -> None:
    out = call("run_command", {"argv": ["true"], "env": {name: "x"}}, ws)
    assert out.state is ItemState.FAILED and out.error_class == Reason.ENV_DENIED.value


def test_run_command_model_env_plain_name_passes(ws: Path) -> None:
    out = call("run_command", {"argv": ["printenv", "CI"], "env": {"CI": "1"}}, ws)
    assert out.output == b"1\n"


def test_run_command_stdin_closed(ws: Path) -> None:
    out = call("run_command", {"argv": ["cat"], "timeout_s": 5}, ws)
    assert out.state is ItemState.EXECUTED and out.exit_code == 0 and out.output == b""


def test_run_command_timeout_kills_group(ws: Path) -> None:
    script = "import subprocess,time; subprocess.Popen(['sleep','30']); time.sleep(30)"
    out = call("run_command", {"argv": [sys.executable, "-c", script], "timeout_s": 1}, ws)
    assert out.state is ItemState.FAILED and out.error_class == Reason.TOOL_TIMEOUT.value
    assert out.exit_code is not None and out.exit_code < 0


def test_run_command_output_cap(ws: Path) -> None:
    script = "import sys; sys.stdout.write('y'*100000); sys.stderr.write('E')"
    out = call("run_command", {"argv": [sys.executable, "-c", script]}, ws, limits=Limits(output_max_bytes=1000))
    assert len(out.output) == 1000 and out.output_bytes == 100001 and out.truncated


def test_run_command_exit_code_and_missing_program(ws: Path) -> None:
    assert call("run_command", {"argv": ["false"]}, ws).exit_code == 1
    missing = call("run_command", {"argv": ["no-such-program-xyz"]}, ws)
    assert missing.state is ItemState.FAILED and missing.error_class == Reason.TOOL_FAILED.value
    rel = call("run_command", {"argv": ["./script.sh"]}, ws)
    assert rel.error_class == Reason.SANDBOX_VIOLATION.value


def test_run_command_git_in_disposable_repo(ws: Path) -> None:
    assert call("run_command", {"argv": ["git", "init", "-q"]}, ws).exit_code == 0
    assert call("run_command", {"argv": ["git", "add", "--", "src/a.txt"]}, ws).exit_code == 0
    status = call("run_command", {"argv": ["git", "status", "--porcelain"]}, ws)
    assert status.exit_code == 0 and b"A  src/a.txt" in status.output


# --- http_request ---------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"z" * 50_000 if self.path == "/big" else b"pong"
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://evil.example/")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[::-1])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_request_allowlisted(ws: Path, http_server: str) -> None:
    allowed = frozenset({"127.0.0.1"})
    out = call("http_request", {"method": "GET", "url": http_server + "/ping"}, ws, allowed_hosts=allowed)
    assert (out.state, out.exit_code, out.output) == (ItemState.EXECUTED, 200, b"pong")
    post = call("http_request", {"method": "POST", "url": http_server + "/", "body": "abc"}, ws,
                allowed_hosts=allowed)
    assert (post.exit_code, post.output) == (201, b"cba")


def test_http_request_host_not_allowed(ws: Path, http_server: str) -> None:
    out = call("http_request", {"method": "GET", "url": http_server + "/ping"}, ws,
               allowed_hosts=frozenset({"example.com"}))
    assert out.state is ItemState.FAILED and out.error_class == Reason.HOST_NOT_ALLOWED.value
    creds = call("http_request", {"method": "GET", "url": http_server.replace("//", "//u:p@")}, ws,
                 allowed_hosts=frozenset({"127.0.0.1"}))
    assert creds.error_class == Reason.SANDBOX_VIOLATION.value
    host_hdr = call("http_request", {"method": "GET", "url": http_server, "headers": {"Host": "evil"}}, ws,
                    allowed_hosts=frozenset({"127.0.0.1"}))
    assert host_hdr.error_class == Reason.SANDBOX_VIOLATION.value


def test_http_request_no_redirect_and_size_cap(ws: Path, http_server: str) -> None:
    allowed = frozenset({"127.0.0.1"})
    red = call("http_request", {"method": "GET", "url": http_server + "/redirect"}, ws, allowed_hosts=allowed)
    assert red.exit_code == 302 and red.state is ItemState.EXECUTED
    big = call("http_request", {"method": "GET", "url": http_server + "/big"}, ws, allowed_hosts=allowed,
               limits=Limits(http_max_response_bytes=1000))
    assert len(big.output) == 1000 and big.truncated and big.output_bytes > 1000


def test_http_request_timeout(ws: Path) -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the TCP connection, never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        out = call("http_request", {"method": "GET", "url": url}, ws, allowed_hosts=frozenset({"127.0.0.1"}),
                   limits=Limits(http_timeout_s=0.5))
        assert out.state is ItemState.FAILED and out.error_class == Reason.TOOL_TIMEOUT.value
    finally:
        listener.close()


def test_read_for_digest(ws: Path) -> None:
    assert files.read_for_digest(str(ws), "src/a.txt", 100) == b"hello"
    assert files.read_for_digest(str(ws), "src/a.txt", 3) is None
    assert files.read_for_digest(str(ws), "missing", 100) is None


def test_host_allowed_wildcards() -> None:
    from callgate.hosts import host_allowed

    allowed = frozenset({"*.example.com", "api.test"})
    assert host_allowed("a.example.com", allowed) and host_allowed("api.test", allowed)
    assert not host_allowed("example.com", allowed)
    assert not host_allowed("evil-example.com", allowed)
    assert not host_allowed("api.test.evil", allowed)
