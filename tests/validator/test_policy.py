"""Catalogue 2.3 (P1-P10), 2.4 (commands, arguments, env), http and approval rules,
each through the validator core, asserting the exact Reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from callgate.errors import Reason
from callgate.states import ItemState
from validator.core import Approved, Pending, Rejected, Stage
from validator.policy import PolicyLoadError, load_policy

from tests.validator.helpers import fresh_state, item, make_validator, make_workspace, write_policy


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("policy")
    root = make_workspace(base)
    return root, make_validator(write_policy(base, root))


def decide(env, tool, args):
    _, validator = env
    return validator.decide(item(tool, args), fresh_state())


def rejected(env, tool, args) -> Rejected:
    decision = decide(env, tool, args)
    assert isinstance(decision, Rejected), decision
    assert decision.state is ItemState.REJECTED
    return decision


PATH_BAD = [
    # P1: dot-dot, lexically or buried
    ("P1-dotdot", "../x", Reason.PATH_ESCAPE),
    ("P1-buried", "a/../../x", Reason.PATH_ESCAPE),
    ("P1-only", "..", Reason.PATH_ESCAPE),
    ("P1-dot", "./a", Reason.PATH_INVALID),
    ("P1-empty-segment", "a//b", Reason.PATH_INVALID),
    ("P1-trailing-slash", "src/", Reason.PATH_INVALID),
    # P2: absolute paths outside the root
    ("P2-etc-passwd", "/etc/passwd", Reason.PATH_ABSOLUTE),
    ("P2-double-slash", "//etc/passwd", Reason.PATH_ABSOLUTE),
    # P4: symlinks leaving the root
    ("P4-dir-link-out", "link_out/secret.txt", Reason.PATH_SYMLINK_ESCAPE),
    ("P4-file-link-out", "file_out", Reason.PATH_SYMLINK_ESCAPE),
    ("P4-link-onto-denied", "innocent.txt", Reason.PATH_DENIED),
    # P3: prefix sibling through a link
    ("P3-sibling-link", "link_sibling/x", Reason.PATH_SYMLINK_ESCAPE),
    # P6: NUL (J11: escaped NUL accepted by the parser)
    ("P6-nul", "a\x00b", Reason.PATH_NUL_BYTE),
    # P7: Unicode normalisation
    ("P7-nfd", "caf\u0065\u0301.txt", Reason.PATH_INVALID),
    ("P7-fullwidth-dotdot", "\uff0e\uff0e\uff0fetc", Reason.PATH_INVALID),
    ("P7-one-dot-leader", "\u2024\u2024/etc", Reason.PATH_INVALID),
    ("P7-ligature", "\ufb01le.txt", Reason.PATH_INVALID),
    # P8: case folding of protected names, and ignorable code points
    ("P8-git-upper", ".GIT/config", Reason.PATH_DENIED),
    ("P8-git-mixed", ".Git/hooks/pre-commit", Reason.PATH_DENIED),
    ("P8-git-dir", ".git", Reason.PATH_DENIED),
    ("P8-env", ".env", Reason.PATH_DENIED),
    ("P8-env-local-nested", "sub/.ENV.local", Reason.PATH_DENIED),
    ("P8-workflows", ".github/WORKFLOWS/ci.yml", Reason.PATH_DENIED),
    ("P8-claude", ".claude/settings.json", Reason.PATH_DENIED),
    ("P8-zwnj", ".g\u200cit/config", Reason.PATH_INVALID),
    ("P8-policy-glob", "certs/server.PEM", Reason.PATH_DENIED),
    # P9: Windows forms, whatever the host OS
    ("P9-backslash", "..\\..\\etc\\passwd", Reason.PATH_INVALID),
    ("P9-drive-relative", "D:evil", Reason.PATH_INVALID),
    ("P9-ads", "file.txt:stream", Reason.PATH_INVALID),
    ("P9-unc", "\\\\server\\share", Reason.PATH_INVALID),
    ("P9-trailing-dot", "src/a.", Reason.PATH_INVALID),
    ("P9-trailing-space", "src/a ", Reason.PATH_INVALID),
    ("P9-con", "CON", Reason.PATH_INVALID),
    ("P9-nul-ext", "logs/nul.txt", Reason.PATH_INVALID),
    ("P9-com1", "com1", Reason.PATH_INVALID),
    # P10: percent-encoding is never decoded into a path
    ("P10-encoded-dotdot", "%2e%2e/etc", Reason.PATH_INVALID),
    ("P10-encoded-slash", "a%2fb", Reason.PATH_INVALID),
    # control characters (S8: "$" and patterns are not the defence)
    ("ctrl-newline", "a\n", Reason.PATH_INVALID),
    ("ctrl-escape", "a\x1b[2J", Reason.PATH_INVALID),
    ("bidi-override", "a\u202etxt.exe", Reason.PATH_INVALID),
]


@pytest.mark.parametrize(("case", "path", "reason"), PATH_BAD, ids=[c[0] for c in PATH_BAD])
@pytest.mark.parametrize("tool", ["write_file", "read_file"])
def test_bad_paths(env, case, path, reason, tool) -> None:
    args = {"path": path, "content": "x"} if tool == "write_file" else {"path": path}
    decision = rejected(env, tool, args)
    assert decision.reason is reason
    assert decision.stage is Stage.POLICY
    assert decision.audit.policy_status == "denied" and decision.audit.schema_status == "valid"


def test_prefix_sibling_absolute(env) -> None:
    root, _ = env
    decision = rejected(env, "read_file", {"path": f"{root}_evil/x"})
    assert decision.reason is Reason.PATH_ABSOLUTE


def test_absolute_inside_root_becomes_relative(env) -> None:
    root, _ = env
    decision = decide(env, "read_file", {"path": f"{root}/src/main.py"})
    assert isinstance(decision, Approved)
    assert json.loads(decision.arguments) == {"path": "src/main.py"}


def test_in_root_link_is_allowed_but_the_lexical_path_is_authorised(env) -> None:
    # P5: the executor opens the checked path with O_NOFOLLOW; the validator hands
    # it the lexical relative path, never a resolved one it could swap later
    decision = decide(env, "write_file", {"path": "src_link/new.py", "content": "x"})
    assert isinstance(decision, Approved)
    assert json.loads(decision.arguments)["path"] == "src_link/new.py"


@pytest.mark.parametrize("path", ["src/main.py", "README.md", "src/deep/new/file.txt", "a b.txt", "ünïcode.txt"])
def test_good_paths(env, path) -> None:
    decision = decide(env, "write_file", {"path": path, "content": "x", "create_dirs": True})
    assert isinstance(decision, Approved), decision
    assert decision.workspace == str(env[0])


def test_list_dir_root_allowed_but_write_to_root_not(env) -> None:
    assert isinstance(decide(env, "list_dir", {"path": "."}), Approved)
    assert rejected(env, "write_file", {"path": ".", "content": "x"}).reason is Reason.PATH_INVALID
    assert rejected(env, "list_dir", {"path": "link_out"}).reason is Reason.PATH_SYMLINK_ESCAPE


COMMAND_BAD = [
    # programs: allow-list, explicit paths, shells
    ("bash-c", ["bash", "-c", "id"], Reason.COMMAND_NOT_ALLOWED),
    ("sh", ["sh", "-c", "id"], Reason.COMMAND_NOT_ALLOWED),
    ("relative-git", ["./git", "status"], Reason.COMMAND_NOT_ALLOWED),
    ("other-git-path", ["/tmp/git", "status"], Reason.COMMAND_NOT_ALLOWED),
    ("bat", ["build.bat"], Reason.COMMAND_NOT_ALLOWED),
    ("python", ["python3", "-c", "print(1)"], Reason.COMMAND_NOT_ALLOWED),
    ("pytest-conftest", ["pytest"], Reason.COMMAND_NOT_ALLOWED),
    ("npm-install", ["npm", "install"], Reason.COMMAND_NOT_ALLOWED),
    # git argument injection (CVE-2022-24439 family)
    ("git-upload-pack", ["git", "fetch", "--upload-pack=touch /tmp/x", "origin"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-upload-p-abbrev", ["git", "fetch", "--upload-p=touch /tmp/x"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-upl-abbrev", ["git", "ls-remote", "--upl", "evil"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-receive-pack", ["git", "fetch", "--receive-pack", "x"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-exec", ["git", "archive", "--exec=/bin/sh", "HEAD"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-exec-path", ["git", "log", "--exec-path=/tmp"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-config-long", ["git", "log", "--config", "core.pager=id"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-dash-c-first", ["git", "-c", "core.pager=id", "log"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-dash-c-later", ["git", "log", "-c", "core.pager=id"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-dash-c-attached", ["git", "log", "-ccore.sshCommand=id"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-output", ["git", "diff", "--output=/tmp/x"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-ext-transport", ["git", "clone", "ext::sh -c touch% /tmp/pwned"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-fd-transport", ["git", "clone", "fd::17"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-file-transport", ["git", "clone", "FILE:///etc"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-transport-after-dashdash", ["git", "clone", "--", "ext::sh"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-subcommand", ["git", "push", "origin"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-no-subcommand", ["git"], Reason.COMMAND_ARGUMENT_DENIED),
    ("git-work-tree", ["git", "status", "--work-tree=/"], Reason.COMMAND_ARGUMENT_DENIED),
    # GTFOBins-style escapes of allow-listed programs
    ("find-exec", ["find", ".", "-exec", "id", ";"], Reason.COMMAND_ARGUMENT_DENIED),
    ("find-execdir", ["find", ".", "-execdir", "id", ";"], Reason.COMMAND_ARGUMENT_DENIED),
    ("find-delete", ["find", ".", "-delete"], Reason.COMMAND_ARGUMENT_DENIED),
    ("find-fprintf", ["find", ".", "-fprintf", "/tmp/x", "%p"], Reason.COMMAND_ARGUMENT_DENIED),
    ("tar-checkpoint", ["tar", "-cf", "x.tar", "--checkpoint=1", "--checkpoint-action=exec=id", "."],
     Reason.COMMAND_ARGUMENT_DENIED),
    ("tar-to-command", ["tar", "-xf", "x.tar", "--to-command=id"], Reason.COMMAND_ARGUMENT_DENIED),
    ("tar-I", ["tar", "-I", "id", "-cf", "x.tar", "."], Reason.COMMAND_ARGUMENT_DENIED),
    # flag allow-list
    ("ls-unlisted-flag", ["ls", "-R"], Reason.COMMAND_ARGUMENT_DENIED),
    # J11: control characters in argv
    ("argv-nul", ["echo", "a\x00b"], Reason.COMMAND_ARGUMENT_DENIED),
    ("argv-newline", ["echo", "a\nb"], Reason.COMMAND_ARGUMENT_DENIED),
]


@pytest.mark.parametrize(("case", "argv", "reason"), COMMAND_BAD, ids=[c[0] for c in COMMAND_BAD])
def test_bad_commands(env, case, argv, reason) -> None:
    if argv[0] in ("find", "tar", "git", "echo", "ls") and shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} not installed")
    assert rejected(env, "run_command", {"argv": argv}).reason is reason


def test_shell_metacharacters_are_literal_arguments(env) -> None:
    argv = ["echo", "$(id); `id` | cat > /etc/passwd"]
    decision = decide(env, "run_command", {"argv": argv})
    assert isinstance(decision, Approved)
    authorised = json.loads(decision.arguments)["argv"]
    assert authorised[0] == shutil.which("echo", path="/usr/local/bin:/usr/bin:/bin")  # absolute, not PATH
    assert authorised[1:] == argv[1:]


def test_git_status_approved_and_commit_needs_approval(env) -> None:
    decision = decide(env, "run_command", {"argv": ["git", "status"], "cwd": "src", "timeout_s": 10})
    assert isinstance(decision, Approved)
    assert json.loads(decision.arguments) == {"argv": ["/usr/bin/git", "status"], "cwd": "src", "timeout_s": 10}
    pending = decide(env, "run_command", {"argv": ["git", "commit", "-m", "msg"]})
    assert isinstance(pending, Pending) and pending.why == "git_commit"
    assert pending.state is ItemState.PENDING_APPROVAL and pending.audit.policy_status == "pending"


def test_cwd_and_timeout_rules(env) -> None:
    assert rejected(env, "run_command", {"argv": ["ls"], "cwd": "../.."}).reason is Reason.PATH_ESCAPE
    assert rejected(env, "run_command", {"argv": ["ls"], "cwd": "/"}).reason is Reason.PATH_ABSOLUTE
    assert rejected(env, "run_command", {"argv": ["ls"], "cwd": "link_out"}).reason is Reason.PATH_SYMLINK_ESCAPE
    # within the schema's bound (600) but over this policy's max_timeout_s (60)
    assert rejected(env, "run_command", {"argv": ["ls"], "timeout_s": 300}).reason is Reason.COMMAND_ARGUMENT_DENIED


ENV_BAD = [
    {"LD_PRELOAD": "/tmp/evil.so"}, {"LD_LIBRARY_PATH": "/tmp"}, {"LD_AUDIT": "x"},
    {"DYLD_INSERT_LIBRARIES": "x"}, {"BASH_ENV": "/tmp/x"}, {"ENV": "/tmp/x"},
    {"GIT_SSH_COMMAND": "id"}, {"GIT_CONFIG_COUNT": "1"}, {"GIT_EXEC_PATH": "/tmp"},
    {"PYTHONSTARTUP": "x"}, {"PYTHONPATH": "x"}, {"NODE_OPTIONS": "--require /tmp/x"},
    {"PERL5OPT": "-Mx"}, {"RUBYOPT": "-rx"}, {"JAVA_TOOL_OPTIONS": "x"},
    {"PATH": "/tmp"}, {"IFS": "x"}, {"PS4": "$(id)"}, {"PROMPT_COMMAND": "id"},
    {"ld_preload": "x"},  # case does not help
    {"BASH_FUNC_ls%%": "() { id; }"},  # malformed name
    {"LANG": "() { :;}; id"},  # Shellshock value in an allow-listed name
    {"FOO": "bar"},  # not on the allow-list
]


@pytest.mark.parametrize("env_vars", ENV_BAD, ids=[next(iter(e)) for e in ENV_BAD])
def test_model_env_denied(env, env_vars) -> None:
    assert rejected(env, "run_command", {"argv": ["ls"], "env": env_vars}).reason is Reason.ENV_DENIED


def test_allowlisted_env_passes(env) -> None:
    assert isinstance(decide(env, "run_command", {"argv": ["ls"], "env": {"LANG": "C.UTF-8"}}), Approved)


HTTP_BAD = [
    ("userinfo", "GET", "https://example.com@evil.com/", Reason.HOST_NOT_ALLOWED),
    ("userinfo-encoded", "GET", "https://example.com%40evil.com/", Reason.HOST_NOT_ALLOWED),
    ("scheme-http", "GET", "http://example.com/", Reason.HOST_NOT_ALLOWED),
    ("scheme-file", "GET", "file:///etc/passwd", Reason.HOST_NOT_ALLOWED),
    ("scheme-ftp", "GET", "ftp://example.com/", Reason.HOST_NOT_ALLOWED),
    ("scheme-javascript", "GET", "javascript:alert(1)", Reason.HOST_NOT_ALLOWED),
    ("backslash", "GET", "https://evil.com\\@example.com/", Reason.HOST_NOT_ALLOWED),
    ("other-host", "GET", "https://evil.com/", Reason.HOST_NOT_ALLOWED),
    ("suffix-trick", "GET", "https://example.com.evil.com/", Reason.HOST_NOT_ALLOWED),
    ("prefix-trick", "GET", "https://evilexample.com/", Reason.HOST_NOT_ALLOWED),
    ("wildcard-apex", "GET", "https://githubusercontent.com/", Reason.HOST_NOT_ALLOWED),
    ("port", "GET", "https://example.com:8443/", Reason.HOST_NOT_ALLOWED),
    ("ip-literal", "GET", "https://127.0.0.1/", Reason.HOST_NOT_ALLOWED),
    ("metadata-ip", "GET", "https://169.254.169.254/latest/", Reason.HOST_NOT_ALLOWED),
    ("ipv6", "GET", "https://[::1]/", Reason.HOST_NOT_ALLOWED),
    ("idn", "GET", "https://exаmple.com/", Reason.HOST_NOT_ALLOWED),  # Cyrillic a
    ("method", "DELETE", "https://example.com/", Reason.METHOD_NOT_ALLOWED),
]


@pytest.mark.parametrize(("case", "method", "url", "reason"), HTTP_BAD, ids=[c[0] for c in HTTP_BAD])
def test_bad_http(env, case, method, url, reason) -> None:
    decision = decide(env, "http_request", {"method": method, "url": url})
    # a malformed URI may already fail the schema's format check: never approved either way
    assert isinstance(decision, Rejected)
    if decision.stage is Stage.SCHEMA:
        assert decision.reason is Reason.SCHEMA_INVALID and decision.detail_code == "format"
    else:
        assert decision.reason is reason


@pytest.mark.parametrize("headers", [{"Host": "evil.com"}, {"Transfer-Encoding": "chunked"},
                                     {"Proxy-Authorization": "x"}, {"X-A": "a\r\nInjected: 1"},
                                     {"X-A": "a\x00"}, {"Bad Name": "x"}, {"X-Forwarded-For": "1.2.3.4"}])
def test_bad_headers(env, headers) -> None:
    decision = rejected(env, "http_request", {"method": "GET", "url": "https://example.com/", "headers": headers})
    assert decision.reason is Reason.HEADER_DENIED


def test_good_http_needs_approval(env) -> None:
    decision = decide(env, "http_request", {"method": "GET", "url": "https://raw.githubusercontent.com/a/b"})
    assert isinstance(decision, Pending) and decision.why == "network_access"
    assert decision.expires_at == 1_000_000 + env[1].approval_ttl_ms


def test_call_cap(tmp_path) -> None:
    root = make_workspace(tmp_path)
    validator = make_validator(write_policy(tmp_path, root, cap=2))
    state = fresh_state()
    results = [validator.decide(item("list_dir", {"path": "."}), state) for _ in range(3)]
    assert [type(r) for r in results] == [Approved, Approved, Rejected]
    assert results[2].reason is Reason.CALL_CAP_EXCEEDED
    # a redelivered call is not counted twice, and other runs have their own budget
    again = item("list_dir", {"path": "."}, call_id="same")
    other = fresh_state("run-2")
    assert isinstance(validator.decide(again, other), Approved)
    assert isinstance(validator.decide(again, other), Approved)
    assert other.calls_counted == 1


def test_unknown_policy_and_unruled_tool(env, tmp_path) -> None:
    _, validator = env
    decision = validator.decide(item("list_dir", {"path": "."}, policy_id="nope"), fresh_state())
    assert isinstance(decision, Rejected) and decision.reason is Reason.UNKNOWN_POLICY
    # a registered tool the policy has no rule for is denied (POLICY_ERROR), never waved through
    from validator.core import Validator
    from validator.registry import ToolRegistry

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "open_pull_request",
              "type": "object", "properties": {"title": {"type": "string"}}, "unevaluatedProperties": False}
    reg = ToolRegistry.from_schemas({"open_pull_request": schema})
    v = Validator(reg, validator.policies)
    decision = v.decide(item("open_pull_request", {"title": "x"}, tool_set=["open_pull_request"]), fresh_state())
    assert isinstance(decision, Rejected) and decision.reason is Reason.POLICY_ERROR


@pytest.mark.parametrize("toml", [
    '[policy]\nid="x"\nversion="1"\nworkspace_root="/w"\n[paths]\nalow=["**"]\n',  # misspelt key
    '[policy]\nid="x"\nversion="1"\nworkspace_root="/w"\n[comands.git]\n',  # misspelt section
    '[policy]\nid="x"\nversion="1"\nworkspace_root="/w"\n[commands.git]\npath="git"\n',  # relative program
    '[policy]\nid="x"\nworkspace_root="/w"\n',  # no version
    '[policy]\nid="x"\nversion="1"\nworkspace_root="/w"\nmax_calls_per_run=true\n',
    'not toml at all [',
])
def test_bad_policy_files_refused(tmp_path, toml) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml)
    with pytest.raises(PolicyLoadError):
        load_policy(path)


def test_demo_policy_loads() -> None:
    policy = load_policy(Path(__file__).resolve().parents[2] / "policies" / "demo.toml")
    assert policy.policy_id == "demo" and policy.workspace_root.startswith("/")
    assert "git" in policy.commands
