"""Workspace policy: a declarative TOML file per workspace, applied after the schema.

The policy is data, loaded from the operator's policy directory, never from
the repository the agent works in. `Policy.evaluate(tool, args)` returns the
*authorised form* of the arguments (paths made canonical and relative,
argv[0] replaced by the program's absolute path) or raises PolicyError with
a Reason; the executor runs exactly that form.

Paths are checked on the canonical string, then resolved with `realpath` at
check time to catch symlinks that leave the root. That check is not enough
on its own (a symlink can be swapped in after it: TOCTOU, catalogue P5): the
executor re-checks at open time, walking with `dir_fd` + `O_NOFOLLOW`.

File format (see policies/demo.toml):

    [policy]    id, version, workspace_root (absolute, or relative to the file),
                max_calls_per_run
    [paths]     allow / deny globs relative to the root, compared case-folded;
                a pattern without "/" matches any single segment, one with "/"
                matches the path or any of its leading directories; `**` spans
                directories, `*` and `?` stay within one segment
    [commands.NAME]  path (absolute; else looked up once at load on a fixed
                PATH), subcommands, allowed_flags, deny_args, max_args
    [env]       allow: names the model may set for run_command
    [http]      allowed_hosts ("*.example.com" matches subdomains only),
                allowed_schemes, allowed_methods, allowed_ports
    [[approval]] rule, tools, optional programs / subcommands for run_command
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callgate.errors import PolicyError, Reason
from callgate.hosts import host_allowed

from validator.strict_json import FrozenDict, freeze, thaw

# Looked up once at load, never the agent's or the worker's PATH.
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
MAX_PATH_BYTES = 1024
MAX_SEGMENT_BYTES = 255

_WINDOWS_DEVICES = frozenset(
    {"con", "prn", "aux", "nul", "conin$", "conout$"}
    | {f"com{i}" for i in range(10)}
    | {f"lpt{i}" for i in range(10)}
)
# Unicode categories that never belong in a path: controls, format chars
# (zero-width joiners, bidi overrides, HFS+-ignorable points), surrogates,
# private use, unassigned.
_BAD_PATH_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})

DEFAULT_PATH_DENY = (
    ".git", ".github/workflows", ".env*", ".claude", ".codex", ".ssh", ".gnupg",
    ".aws", ".netrc", ".npmrc", ".pypirc", ".git-credentials", ".gitmodules",
    ".husky", ".pre-commit-config.yaml",
)

# Always denied, whatever the policy file says (argument injection, CWE-88).
BUILTIN_DENY_ARGS: dict[str, tuple[str, ...]] = {
    "git": (
        "--upload-pack", "--receive-pack", "--exec", "--exec-path", "-c", "--config",
        "--config-env", "--output", "--git-dir", "--work-tree", "--namespace", "-C",
        "--super-prefix", "--template", "--separate-git-dir", "--ext-diff", "--textconv",
        "--no-verify", "--paginate", "--open-files-in-pager", "-O",
    ),
    "find": ("-exec", "-execdir", "-ok", "-okdir", "-delete", "-fprint", "-fprint0", "-fprintf", "-fls"),
    "tar": ("--checkpoint-action", "--to-command", "--use-compress-program", "-I",
            "--rsh-command", "--info-script", "--new-volume-script", "-F"),
    "rsync": ("-e", "--rsh", "--rsync-path"),
    "ssh": ("-o", "-F"),
    "zip": ("-TT", "--unzip-command", "-T"),
}
# Transports that run code or read local files, denied in any argument.
BUILTIN_DENY_SUBSTRINGS = ("ext::", "fd::", "file://")
# Program kinds never run from the gate (BatBadBut) and never resolved from PATH.
_DENIED_PROGRAM_SUFFIXES = (".bat", ".cmd", ".com", ".ps1")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DENIED_ENV_PREFIXES = (
    "LD_", "DYLD_", "BASH_FUNC_", "GIT_", "PYTHON", "NODE_", "PERL5", "PERL_", "RUBY",
    "JAVA_", "_JAVA_", "JDK_", "NPM_CONFIG_", "PIP_", "SSH_", "AWS_", "GCE_", "GOOGLE_", "AZURE_",
)
_DENIED_ENV_NAMES = frozenset(
    {"BASH_ENV", "ENV", "PATH", "IFS", "PS1", "PS2", "PS4", "PROMPT_COMMAND", "HOME", "SHELL",
     "SHELLOPTS", "BASHOPTS", "CDPATH", "GLOBIGNORE", "LD", "EDITOR", "VISUAL", "PAGER",
     "LESSOPEN", "LESSCLOSE", "MANPAGER", "TMPDIR", "HISTFILE", "GCONV_PATH", "LOCPATH",
     "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF"}
)

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_DENIED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer",
     "upgrade", "expect", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip"}
)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class PolicyLoadError(Exception):
    """A policy file is unusable; the validator refuses to start with it."""


def deny(reason: Reason, detail: str) -> PolicyError:
    return PolicyError(reason, detail)


# ---------------------------------------------------------------- globs


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


@dataclass(frozen=True, slots=True)
class GlobSet:
    patterns: tuple[str, ...]
    _segment: tuple[re.Pattern[str], ...] = field(default=(), repr=False)
    _anchored: tuple[re.Pattern[str], ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, patterns: Iterable[str]) -> GlobSet:
        folded = tuple(p.casefold().strip("/") for p in patterns)
        return cls(
            patterns=folded,
            _segment=tuple(_glob_regex(p) for p in folded if "/" not in p),
            _anchored=tuple(_glob_regex(p) for p in folded if "/" in p),
        )

    def matches(self, relative: str) -> bool:
        """True if a segment matches a segment pattern, or the path or a leading
        directory of it matches an anchored pattern (so ".git" covers ".git/config")."""
        segments = relative.casefold().split("/")
        if any(rx.match(seg) for rx in self._segment for seg in segments):
            return True
        prefixes = ["/".join(segments[: i + 1]) for i in range(len(segments))]
        return any(rx.match(prefix) for rx in self._anchored for prefix in prefixes)


# ---------------------------------------------------------------- paths


def lexical_path(raw: str, root: str, *, allow_root: bool = False) -> str:
    """The canonical relative form of a model-supplied path, or PolicyError.

    Rejects rather than repairs: nothing is normalised after validation.
    """
    if not isinstance(raw, str):
        raise deny(Reason.PATH_INVALID, "not_a_string")
    if "\x00" in raw:
        raise deny(Reason.PATH_NUL_BYTE, "nul_byte")
    if raw == "":
        raise deny(Reason.PATH_INVALID, "empty")
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise deny(Reason.PATH_INVALID, "too_long")
    for ch in raw:
        if unicodedata.category(ch) in _BAD_PATH_CATEGORIES:
            raise deny(Reason.PATH_INVALID, "control_or_format_char")
    if "\\" in raw:
        raise deny(Reason.PATH_INVALID, "backslash")
    if ":" in raw:
        raise deny(Reason.PATH_INVALID, "colon")
    if "%" in raw:
        raise deny(Reason.PATH_INVALID, "percent")
    if unicodedata.normalize("NFC", raw) != raw or unicodedata.normalize("NFKC", raw) != raw:
        raise deny(Reason.PATH_INVALID, "unicode_normalization")
    relative = raw
    if raw.startswith("/"):
        # join(root, "/etc/x") would discard root: only a path inside root is accepted
        if raw == root or raw == root + "/":
            relative = "."
        elif raw.startswith(root + "/"):
            relative = raw[len(root) + 1 :]
        else:
            raise deny(Reason.PATH_ABSOLUTE, "outside_root")
    if relative == ".":
        if allow_root:
            return "."
        raise deny(Reason.PATH_INVALID, "dot_segment")
    for segment in relative.split("/"):
        if segment == "..":
            raise deny(Reason.PATH_ESCAPE, "dotdot_segment")
        if segment == "":
            raise deny(Reason.PATH_INVALID, "empty_segment")
        if segment == ".":
            raise deny(Reason.PATH_INVALID, "dot_segment")
        if segment.endswith((".", " ")) or segment.startswith(" "):
            raise deny(Reason.PATH_INVALID, "trailing_dot_or_space")
        if segment.split(".", 1)[0].casefold().rstrip(" ") in _WINDOWS_DEVICES:
            raise deny(Reason.PATH_INVALID, "windows_device_name")
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise deny(Reason.PATH_INVALID, "segment_too_long")
    return relative


def contained(root_real: str, target_real: str) -> bool:
    # commonpath, not startswith: "/repo_evil" is not inside "/repo" (CVE-2026-34451)
    try:
        return os.path.commonpath([root_real, target_real]) == root_real
    except ValueError:
        return False


# ---------------------------------------------------------------- the policy


@dataclass(frozen=True, slots=True)
class CommandRule:
    name: str
    path: str | None
    subcommands: frozenset[str] | None
    allowed_flags: frozenset[str] | None
    deny_args: tuple[str, ...]
    max_args: int


@dataclass(frozen=True, slots=True)
class ApprovalRule:
    rule: str
    tools: frozenset[str]
    programs: frozenset[str] | None = None
    subcommands: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class PolicyOutcome:
    """The authorised form of the arguments, and the approval rule that applies, if any."""

    args: FrozenDict
    approval_rule: str | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    policy_id: str
    version: str
    workspace_root: str
    max_calls_per_run: int
    path_allow: GlobSet
    path_deny: GlobSet
    commands: Mapping[str, CommandRule]
    env_allow: frozenset[str]
    http_hosts: tuple[str, ...]
    http_schemes: frozenset[str]
    http_methods: frozenset[str] | None
    http_ports: frozenset[int]
    approvals: tuple[ApprovalRule, ...]
    max_timeout_s: int = 600

    # -------------------------------------------------------- entry point

    def evaluate(self, tool_name: str, args: Mapping[str, Any]) -> PolicyOutcome:
        """Authorise one schema-valid call, or raise PolicyError (deny)."""
        check = _TOOL_CHECKS.get(tool_name)
        if check is None:
            # a registered tool with no policy section is denied, not waved through
            raise deny(Reason.POLICY_ERROR, "no_rule_for_tool")
        authorised = check(self, thaw(args))
        return PolicyOutcome(freeze(authorised), self._approval_rule(tool_name, authorised))

    def _approval_rule(self, tool_name: str, args: Mapping[str, Any]) -> str | None:
        for rule in self.approvals:
            if tool_name not in rule.tools:
                continue
            if tool_name == "run_command":
                argv = args["argv"]
                program = os.path.basename(argv[0])
                if rule.programs is not None and program not in rule.programs:
                    continue
                if rule.subcommands is not None and (len(argv) < 2 or argv[1] not in rule.subcommands):
                    continue
            return rule.rule
        return None

    # -------------------------------------------------------- paths

    def check_path(self, raw: str, *, allow_root: bool = False) -> str:
        root = self.workspace_root
        relative = lexical_path(raw, root, allow_root=allow_root)
        if relative != ".":
            self._check_globs(relative)
        root_real = os.path.realpath(root)
        target = root if relative == "." else os.path.join(root, relative)
        target_real = os.path.realpath(target)
        if not contained(root_real, target_real):
            raise deny(Reason.PATH_SYMLINK_ESCAPE, "symlink_outside_root")
        resolved_relative = os.path.relpath(target_real, root_real)
        if resolved_relative != "." and resolved_relative != relative:
            # a symlink to .git/config is a write to .git/config
            self._check_globs(resolved_relative.replace(os.sep, "/"))
        return relative

    def _check_globs(self, relative: str) -> None:
        if self.path_deny.matches(relative):
            raise deny(Reason.PATH_DENIED, "deny_glob")
        if not self.path_allow.matches(relative):
            raise deny(Reason.PATH_DENIED, "no_allow_glob")

    # -------------------------------------------------------- tools

    def _read_file(self, args: dict[str, Any]) -> dict[str, Any]:
        args["path"] = self.check_path(args["path"])
        _require_int(args, "max_bytes")
        return args

    def _write_file(self, args: dict[str, Any]) -> dict[str, Any]:
        args["path"] = self.check_path(args["path"])
        if "create_dirs" in args and type(args["create_dirs"]) is not bool:
            raise deny(Reason.POLICY_ERROR, "not_a_boolean")
        return args

    def _list_dir(self, args: dict[str, Any]) -> dict[str, Any]:
        args["path"] = self.check_path(args["path"], allow_root=True)
        return args

    def _run_command(self, args: dict[str, Any]) -> dict[str, Any]:
        argv = args["argv"]
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            # the schema already demands string[]; a string here is a registry bug
            raise deny(Reason.POLICY_ERROR, "argv_not_list")
        rule, program_path = self._resolve_program(argv[0])
        self._check_arguments(rule, argv)
        args["argv"] = [program_path, *argv[1:]]
        if "cwd" in args:
            args["cwd"] = self.check_path(args["cwd"], allow_root=True)
        timeout = _require_int(args, "timeout_s")
        if timeout is not None and not 1 <= timeout <= self.max_timeout_s:
            raise deny(Reason.COMMAND_ARGUMENT_DENIED, "timeout_out_of_policy")
        if "env" in args:
            self._check_env(args["env"])
        return args

    def _resolve_program(self, argv0: str) -> tuple[CommandRule, str]:
        if "\x00" in argv0 or any(unicodedata.category(c) == "Cc" for c in argv0):
            raise deny(Reason.COMMAND_NOT_ALLOWED, "control_char")
        if argv0.casefold().endswith(_DENIED_PROGRAM_SUFFIXES):
            raise deny(Reason.COMMAND_NOT_ALLOWED, "script_suffix")
        if "/" in argv0:
            # an explicit path must be exactly a configured absolute path
            for rule in self.commands.values():
                if rule.path is not None and rule.path == argv0:
                    return rule, rule.path
            raise deny(Reason.COMMAND_NOT_ALLOWED, "path_not_allowlisted")
        rule = self.commands.get(argv0)
        if rule is None:
            raise deny(Reason.COMMAND_NOT_ALLOWED, "program_not_allowlisted")
        if rule.path is None:
            raise deny(Reason.COMMAND_NOT_ALLOWED, "program_unresolved")
        return rule, rule.path

    def _check_arguments(self, rule: CommandRule, argv: list[str]) -> None:
        if len(argv) - 1 > rule.max_args:
            raise deny(Reason.COMMAND_ARGUMENT_DENIED, "too_many_arguments")
        if rule.subcommands is not None:
            if len(argv) < 2 or argv[1] not in rule.subcommands:
                raise deny(Reason.COMMAND_ARGUMENT_DENIED, "subcommand_not_allowed")
        operands_only = False
        for arg in argv[1:]:
            if any(unicodedata.category(c) == "Cc" for c in arg):
                raise deny(Reason.COMMAND_ARGUMENT_DENIED, "control_char")
            folded = arg.casefold()
            if any(s in folded for s in BUILTIN_DENY_SUBSTRINGS):
                raise deny(Reason.COMMAND_ARGUMENT_DENIED, "denied_transport")
            if operands_only:
                continue
            if arg == "--":
                operands_only = True
                continue
            if not arg.startswith("-") or arg == "-":
                continue
            for denied in rule.deny_args:
                if _option_matches(arg, denied):
                    raise deny(Reason.COMMAND_ARGUMENT_DENIED, "denied_option")
            if rule.allowed_flags is not None:
                name = arg.split("=", 1)[0] if arg.startswith("--") else arg
                if name not in rule.allowed_flags:
                    raise deny(Reason.COMMAND_ARGUMENT_DENIED, "flag_not_allowed")

    def _check_env(self, env: Mapping[str, Any]) -> None:
        for name, value in env.items():
            if not isinstance(value, str) or not _ENV_NAME.match(name):
                raise deny(Reason.ENV_DENIED, "malformed_env")
            upper = name.upper()
            if upper in _DENIED_ENV_NAMES or upper.startswith(_DENIED_ENV_PREFIXES):
                raise deny(Reason.ENV_DENIED, "denied_env_family")
            if "\x00" in value or value.lstrip().startswith("()"):
                raise deny(Reason.ENV_DENIED, "denied_env_value")
            if name not in self.env_allow:
                raise deny(Reason.ENV_DENIED, "env_not_allowlisted")

    def _http_request(self, args: dict[str, Any]) -> dict[str, Any]:
        method = args["method"]
        if self.http_methods is not None and method not in self.http_methods:
            raise deny(Reason.METHOD_NOT_ALLOWED, "method_not_allowlisted")
        args["url"] = self._check_url(args["url"])
        for name, value in args.get("headers", {}).items():
            if not _HEADER_NAME.match(name) or not isinstance(value, str):
                raise deny(Reason.HEADER_DENIED, "malformed_header")
            if any(c in value for c in "\r\n\x00") or any(
                unicodedata.category(c) == "Cc" and c != "\t" for c in value
            ):
                raise deny(Reason.HEADER_DENIED, "control_char")
            lowered = name.lower()
            if lowered in _DENIED_HEADERS or lowered.startswith("proxy-"):
                raise deny(Reason.HEADER_DENIED, "denied_header")
        return args

    def _check_url(self, url: str) -> str:
        if any(ord(c) <= 0x20 or ord(c) == 0x7F or ord(c) > 0x7E for c in url) or "\\" in url:
            # WHATWG parsers treat "\" as "/" and strip tabs: refuse any differential
            raise deny(Reason.HOST_NOT_ALLOWED, "url_chars")
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in self.http_schemes:
            raise deny(Reason.HOST_NOT_ALLOWED, "scheme")
        if not url[len(parts.scheme) :].startswith("://"):
            raise deny(Reason.HOST_NOT_ALLOWED, "not_hierarchical")
        if "@" in parts.netloc:
            raise deny(Reason.HOST_NOT_ALLOWED, "userinfo")
        if "%" in parts.netloc:
            raise deny(Reason.HOST_NOT_ALLOWED, "host_encoding")
        host = parts.hostname or ""
        if not host:
            raise deny(Reason.HOST_NOT_ALLOWED, "no_host")
        try:
            port = parts.port
        except ValueError:
            raise deny(Reason.HOST_NOT_ALLOWED, "port") from None
        if port is not None and port != _DEFAULT_PORTS.get(scheme) and port not in self.http_ports:
            raise deny(Reason.HOST_NOT_ALLOWED, "port")
        if not host_allowed(host, self.http_hosts):
            raise deny(Reason.HOST_NOT_ALLOWED, "host_not_allowlisted")
        return url


def _option_matches(arg: str, denied: str) -> bool:
    """Does `arg` spell the denied option, including git-style abbreviations?"""
    if denied.startswith("--"):
        if not arg.startswith("--"):
            return False
        name = arg.split("=", 1)[0]
        # "--upload-p" abbreviates "--upload-pack" (CVE-2026-67325); "--exec-path=x" extends "--exec"
        return len(name) > 2 and (denied.startswith(name) or name.startswith(denied))
    if arg.startswith("--"):
        return False
    if len(denied) == 2:
        # short option: alone, with an attached value, or inside a cluster ("-vc")
        return denied[1] in arg[1:].split("=", 1)[0]
    return arg.startswith(denied)


def _require_int(args: Mapping[str, Any], key: str) -> int | None:
    if key not in args:
        return None
    value = args[key]
    # True is an int to Python (J13); 1.0 is an integer to jsonschema (S9)
    if type(value) is not int:
        raise deny(Reason.POLICY_ERROR, "not_an_integer")
    return value


_TOOL_CHECKS = {
    "read_file": Policy._read_file,
    "write_file": Policy._write_file,
    "list_dir": Policy._list_dir,
    "run_command": Policy._run_command,
    "http_request": Policy._http_request,
}


# ---------------------------------------------------------------- loading


def load_policy(path: Path | str) -> Policy:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PolicyLoadError(f"{path.name}: unreadable ({type(exc).__name__})") from None
    return policy_from_mapping(data, base_dir=path.resolve().parent, label=path.name)


def policy_from_mapping(data: Mapping[str, Any], *, base_dir: Path, label: str = "policy") -> Policy:
    try:
        return _build(data, base_dir)
    except PolicyLoadError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyLoadError(f"{label}: {type(exc).__name__}: {exc}") from None


def _build(data: Mapping[str, Any], base_dir: Path) -> Policy:
    head = data["policy"]
    known_sections = {"policy", "paths", "commands", "env", "http", "approval"}
    unknown = set(data) - known_sections
    if unknown:
        raise PolicyLoadError(f"unknown sections {sorted(unknown)}")
    _known_keys("policy", head, {"id", "version", "workspace_root", "max_calls_per_run", "max_timeout_s"})
    _known_keys("paths", data.get("paths", {}), {"allow", "deny"})
    _known_keys("env", data.get("env", {}), {"allow"})
    _known_keys("http", data.get("http", {}),
                {"allowed_hosts", "allowed_schemes", "allowed_methods", "allowed_ports"})
    for name, spec in data.get("commands", {}).items():
        _known_keys(f"commands.{name}", spec, {"path", "subcommands", "allowed_flags", "deny_args", "max_args"})
    for entry in data.get("approval", ()):
        _known_keys("approval", entry, {"rule", "tools", "programs", "subcommands"})
    root = Path(head["workspace_root"])
    if not root.is_absolute():
        root = base_dir / root
    root_str = os.path.normpath(str(root))
    paths = data.get("paths", {})
    commands = {}
    for name, spec in data.get("commands", {}).items():
        if "/" in name:
            raise PolicyLoadError(f"command key {name!r} must be a bare program name")
        configured = spec.get("path")
        if configured is not None and not os.path.isabs(configured):
            raise PolicyLoadError(f"command {name}: path must be absolute")
        resolved = configured or shutil.which(name, path=SAFE_PATH)
        commands[name] = CommandRule(
            name=name,
            path=resolved,
            subcommands=_opt_set(spec.get("subcommands")),
            allowed_flags=_opt_set(spec.get("allowed_flags")),
            deny_args=tuple(spec.get("deny_args", ())) + BUILTIN_DENY_ARGS.get(name, ()),
            max_args=int(spec.get("max_args", 32)),
        )
    http = data.get("http", {})
    approvals = tuple(
        ApprovalRule(
            rule=str(a["rule"]),
            tools=frozenset(a["tools"]),
            programs=_opt_set(a.get("programs")),
            subcommands=_opt_set(a.get("subcommands")),
        )
        for a in data.get("approval", ())
    )
    max_calls = head.get("max_calls_per_run", 100)
    if type(max_calls) is not int or max_calls < 0:
        raise PolicyLoadError("max_calls_per_run must be a non-negative integer")
    return Policy(
        policy_id=str(head["id"]),
        version=str(head["version"]),
        workspace_root=root_str,
        max_calls_per_run=max_calls,
        path_allow=GlobSet.of(paths.get("allow", ["**"])),
        path_deny=GlobSet.of(tuple(paths.get("deny", ())) + DEFAULT_PATH_DENY),
        commands=commands,
        env_allow=frozenset(data.get("env", {}).get("allow", ())),
        http_hosts=tuple(h.lower() for h in http.get("allowed_hosts", ())),
        http_schemes=frozenset(s.lower() for s in http.get("allowed_schemes", ("https",))),
        http_methods=_opt_set(http.get("allowed_methods")),
        http_ports=frozenset(int(p) for p in http.get("allowed_ports", ())),
        approvals=approvals,
        max_timeout_s=int(head.get("max_timeout_s", 600)),
    )


def _known_keys(section: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    # a misspelt key ("allowed_host") would silently loosen nothing or tighten nothing: refuse it
    unknown = set(table) - allowed
    if unknown:
        raise PolicyLoadError(f"[{section}]: unknown keys {sorted(unknown)}")


def _opt_set(values: Iterable[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)


class PolicySet:
    """Policies by id; an item naming an unknown policy is rejected (UNKNOWN_POLICY)."""

    def __init__(self, policies: Iterable[Policy]) -> None:
        self._by_id: dict[str, Policy] = {}
        for policy in policies:
            if policy.policy_id in self._by_id:
                raise PolicyLoadError(f"policy id {policy.policy_id!r} defined twice")
            self._by_id[policy.policy_id] = policy

    @classmethod
    def load(cls, *paths: Path | str) -> PolicySet:
        """Load files, or every *.toml in the given directories."""
        files: list[Path] = []
        for p in map(Path, paths):
            files.extend(sorted(p.glob("*.toml")) if p.is_dir() else [p])
        return cls(load_policy(f) for f in files)

    def get(self, policy_id: str) -> Policy | None:
        return self._by_id.get(policy_id)

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(self._by_id)
