"""run_command: one argv, no shell, in a scrubbed environment built from scratch.

Nothing of the executor's own environment reaches the child (its Kafka and
signing secrets included). HOME and TMPDIR point at a fresh temp dir that is
removed afterwards, git reads no system or user config, stdin is /dev/null,
stdout and stderr go (merged, in order) to a temp file whose size the child
cannot grow without bound (RLIMIT_FSIZE), and the whole process group is
killed on timeout.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
from typing import Any

from callgate.errors import ExecutionError, Reason
from callgate.states import ItemState
from executor.tools.base import ToolContext, ToolOutcome
from executor.tools.confine import directory

FIXED_PATH = "/usr/local/bin:/usr/bin:/bin"
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,127}")
# Families that turn an environment variable into code execution or config injection.
_DENIED_ENV_PREFIXES = (
    "LD_", "DYLD_", "GIT_", "PYTHON", "NODE_", "NPM_", "PERL", "RUBY", "JAVA_", "_JAVA",
    "BASH", "SSH_", "AWS_", "GOOGLE_", "AZURE_", "GH_", "GITHUB_", "DOCKER_", "KUBE", "XDG_",
)
_DENIED_ENV_NAMES = frozenset(
    {"PATH", "HOME", "TMPDIR", "ENV", "IFS", "PS4", "PROMPT_COMMAND", "SHELLOPTS", "CDPATH",
     "GLOBIGNORE", "EDITOR", "VISUAL", "PAGER", "LESSOPEN", "MANPAGER", "http_proxy", "HTTPS_PROXY",
     "HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "CURL_HOME", "WGETRC", "GNUPGHOME", "LANG", "LC_ALL"}
)


def scrubbed_env(home: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "PATH": FIXED_PATH,
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
    }
    for name, value in (extra or {}).items():
        if (
            not _ENV_NAME.fullmatch(name)
            or name in _DENIED_ENV_NAMES
            or name.startswith(_DENIED_ENV_PREFIXES)
            or "TOKEN" in name or "SECRET" in name or "PASSWORD" in name or "KEY" in name
            or "\x00" in value
        ):
            raise ExecutionError(Reason.ENV_DENIED, "environment name refused")
        env[name] = value
    return env


def resolve_program(program: str) -> str:
    """An absolute program path; never a workspace-relative one, never via the caller's PATH."""
    if "\x00" in program:
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "program form refused")
    if os.path.isabs(program):
        found = program if os.access(program, os.X_OK) and os.path.isfile(program) else None
    elif "/" in program:
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "relative program path refused")
    else:
        found = shutil.which(program, path=FIXED_PATH)
    if found is None:
        raise ExecutionError(Reason.TOOL_FAILED, "program not found")
    return found


def _child_setup(cwd_fd: int, limits: tuple[int, int, float]) -> None:
    # Runs in the child between fork and exec: only async-signal-safe-ish syscalls here.
    fsize, address_space, cpu_s = limits
    os.fchdir(cwd_fd)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    cpu = int(cpu_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def run_command(args: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    argv: list[str] = list(args["argv"])
    if not argv or any(not isinstance(a, str) or "\x00" in a for a in argv):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "argv form refused")
    timeout = min(float(args.get("timeout_s", ctx.limits.command_timeout_s)), ctx.limits.command_max_timeout_s)
    program = resolve_program(argv[0])
    limits = ctx.limits
    home = tempfile.mkdtemp(prefix="callgate-home-")
    try:
        env = scrubbed_env(home, args.get("env"))
        with directory(ctx.workspace, args.get("cwd", ".")) as cwd_fd, tempfile.TemporaryFile(dir=home) as out:
            proc = subprocess.Popen(
                [program, *argv[1:]],
                executable=program,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd="/",  # replaced by fchdir to the verified directory fd
                close_fds=True,
                start_new_session=True,  # its own process group, killed as a whole on timeout
                preexec_fn=lambda: _child_setup(
                    cwd_fd, (limits.command_file_size_bytes, limits.command_address_space_bytes, timeout)
                ),
            )
            timed_out = False
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                code = proc.wait()
            finally:
                _kill_group(proc)  # stragglers the program left behind in its group
            size = os.fstat(out.fileno()).st_size
            out.seek(0)
            kept = out.read(limits.output_max_bytes)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    truncated = size > len(kept)
    if timed_out:
        return ToolOutcome(ItemState.FAILED, kept, size, truncated, code, Reason.TOOL_TIMEOUT.value)
    return ToolOutcome(ItemState.EXECUTED, kept, size, truncated, code)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
