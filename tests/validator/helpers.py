"""Shared builders for the validator tests (real files, real policy TOML)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from pydantic import SecretStr

from callgate.records import TerminalItem
from callgate.settings import Settings

from validator.core import RunState, Validator
from validator.policy import PolicySet, load_policy
from validator.registry import ToolRegistry

ALL_TOOLS = ["read_file", "write_file", "list_dir", "run_command", "http_request"]

POLICY_TOML = """
[policy]
id = "test"
version = "7"
workspace_root = "{root}"
max_calls_per_run = {cap}
max_timeout_s = 60

[paths]
allow = ["**"]
deny = ["*.pem", "secrets"]

[commands.git]
subcommands = ["status", "diff", "log", "fetch", "commit", "clone", "ls-remote", "archive"]

[commands.find]
[commands.tar]
[commands.echo]
[commands.ls]
allowed_flags = ["-l", "-a"]

[env]
allow = ["LANG", "TZ"]

[http]
allowed_hosts = ["example.com", "*.githubusercontent.com"]
allowed_schemes = ["https"]
allowed_methods = ["GET", "HEAD", "POST"]

[[approval]]
rule = "network_access"
tools = ["http_request"]

[[approval]]
rule = "git_commit"
tools = ["run_command"]
programs = ["git"]
subcommands = ["commit"]
"""


def make_workspace(base: Path) -> Path:
    """A workspace with the symlinks the path rules must see through."""
    root = base / "repo"
    (root / "src").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / "src" / "main.py").write_text("print('hi')\n")
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("x")
    sibling = base / "repo_evil"
    sibling.mkdir()
    os.symlink(outside, root / "link_out")  # a directory link leaving the root
    os.symlink(outside / "secret.txt", root / "file_out")
    os.symlink(sibling, root / "link_sibling")  # prefix sibling: /x/repo_evil vs /x/repo
    os.symlink(root / ".git" / "config", root / "innocent.txt")  # in-root link onto a denied file
    os.symlink(root / "src", root / "src_link")  # in-root link onto an allowed dir
    return root


def write_policy(base: Path, root: Path, *, cap: int = 1000, name: str = "test.toml") -> Path:
    path = base / name
    path.write_text(POLICY_TOML.format(root=root, cap=cap))
    return path


def worker_settings(kafka_bootstrap: str, namespace: str, base: Path, key_hex: str, **overrides) -> Settings:
    """Settings for a validator worker in a test: a fresh workspace, the test policy, signing key `k1`."""
    policies = base / "policies"
    policies.mkdir()
    write_policy(policies, make_workspace(base))
    return Settings(
        kafka_bootstrap=kafka_bootstrap, topic_namespace=namespace,
        signing_keys=SecretStr(f"k1:{key_hex}"), signing_key_id="k1", policies_dir=policies, **overrides,
    )


def make_validator(policy_path: Path, **kw) -> Validator:
    return Validator(ToolRegistry.load_dir(), PolicySet([load_policy(policy_path)]), **kw)


def item(tool: str, arguments: bytes | dict, *, tool_set=None, policy_id: str = "test",
         run_id: str = "run-1", call_id: str | None = None, terminal_at: int = 1_000_000) -> TerminalItem:
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments).encode()
    return TerminalItem(
        run_id=run_id, attempt_id="att-1", response_id="resp-1", item_id=f"item-{uuid.uuid4().hex[:8]}",
        call_id=call_id or f"call-{uuid.uuid4().hex}", provider_call_id=None, tool_name=tool,
        arguments=arguments, route="openai_responses", adapter_version="1",
        provider_event="response.output_item.done", tool_set=list(ALL_TOOLS if tool_set is None else tool_set),
        policy_id=policy_id, terminal_at=terminal_at,
    )


def fresh_state(run_id: str = "run-1") -> RunState:
    return RunState(run_id)
