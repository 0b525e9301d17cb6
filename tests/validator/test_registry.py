"""Catalogue 2.2 (S1-S11) and the registry reasons."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import referencing.exceptions

from callgate.errors import Reason, SchemaError
from validator.registry import (
    DEFAULT_SCHEMA_DIR, RegistryLoadError, SchemaInvalid, ToolRegistry, compile_validator,
)
from validator.strict_json import parse_arguments

from tests.validator.helpers import ALL_TOOLS

DIALECT = "https://json-schema.org/draft/2020-12/schema"


@pytest.fixture(scope="module")
def registry() -> ToolRegistry:
    return ToolRegistry.load_dir()


def check(registry: ToolRegistry, tool: str, raw: bytes, tool_set=ALL_TOOLS):
    return registry.check(tool, tool_set, parse_arguments(raw).value)


def test_shipped_schemas_load_and_pin_the_dialect(registry: ToolRegistry) -> None:
    assert registry.names == set(ALL_TOOLS)
    for name in ALL_TOOLS:
        schema = json.loads((DEFAULT_SCHEMA_DIR / f"{name}.json").read_text())
        assert schema["$schema"] == DIALECT
        assert schema["unevaluatedProperties"] is False


SCHEMA_BAD = [
    # S1/S2: format asserted, and uri really checked
    ("S1-uri-format", "http_request", b'{"method":"GET","url":"not a uri"}', "format"),
    ("S1-uri-relative", "http_request", b'{"method":"GET","url":"/just/a/path"}', "format"),
    # unknown properties, required, bounds, enums
    ("unknown-prop", "write_file", b'{"path":"a","content":"x","mode":"append"}', "unevaluatedProperties"),
    ("missing-required", "write_file", b'{"path":"a"}', "required"),
    ("empty-path", "read_file", b'{"path":""}', "minLength"),
    ("max-bytes-too-big", "read_file", b'{"path":"a","max_bytes":99999999999}', "maximum"),
    ("method-enum", "http_request", b'{"method":"TRACE","url":"https://example.com/"}', "enum"),
    ("method-lowercase", "http_request", b'{"method":"get","url":"https://example.com/"}', "enum"),
    ("header-not-string", "http_request",
     b'{"method":"GET","url":"https://example.com/","headers":{"X-A":1}}', "type"),
    # 2.4: a command string is a schema failure, never split by a shell
    ("argv-string", "run_command", b'{"argv":"ls -la; rm -rf /"}', "type"),
    ("argv-empty", "run_command", b'{"argv":[]}', "minItems"),
    ("argv-non-string", "run_command", b'{"argv":["ls", 1]}', "type"),
    ("shell-key", "run_command", b'{"argv":["ls"],"shell":true}', "unevaluatedProperties"),
    ("timeout-over-schema", "run_command", b'{"argv":["ls"],"timeout_s":100000}', "maximum"),
    # J13 / S9: booleans are not integers; 1.0 is refused where an integer is meant
    ("J13-bool-as-int", "read_file", b'{"path":"a","max_bytes":true}', "type"),
    ("S9-float-as-int", "run_command", b'{"argv":["ls"],"timeout_s":5.0}', "type"),
    ("bool-not-bool", "write_file", b'{"path":"a","content":"x","create_dirs":"yes"}', "type"),
    ("list_dir-extra", "list_dir", b'{"path":".","recursive":true}', "unevaluatedProperties"),
]


@pytest.mark.parametrize(("case", "tool", "raw", "keyword"), SCHEMA_BAD, ids=[c[0] for c in SCHEMA_BAD])
def test_schema_failures_name_keyword_only(registry, case, tool, raw, keyword) -> None:
    with pytest.raises(SchemaInvalid) as info:
        check(registry, tool, raw)
    assert info.value.reason is Reason.SCHEMA_INVALID
    assert info.value.keyword == keyword


def test_S11_message_has_no_instance_values(registry) -> None:
    secret = "/home/u/.ssh/id_rsa-hunter2"
    with pytest.raises(SchemaInvalid) as info:
        check(registry, "write_file", json.dumps({"path": secret, "content": 5}).encode())
    assert "hunter2" not in str(info.value) and "id_rsa" not in str(info.value)
    with pytest.raises(SchemaInvalid) as info:
        check(registry, "write_file", json.dumps({"path": "a", "content": "x", "hunter2key": 1}).encode())
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("name", ["Write_File", "write_file ", "writefile", "WRITE_FILE", "write_fil",
                                  "write_file\u200b", "ｗrite_file", ""])
def test_tool_name_exact_match_only(registry, name) -> None:
    with pytest.raises(SchemaError) as info:
        check(registry, name, b'{"path":"a","content":"x"}', tool_set=[*ALL_TOOLS, name])
    assert info.value.reason is Reason.UNKNOWN_TOOL


def test_registered_tool_not_in_run_set(registry) -> None:
    with pytest.raises(SchemaError) as info:
        check(registry, "run_command", b'{"argv":["ls"]}', tool_set=["read_file"])
    assert info.value.reason is Reason.TOOL_NOT_IN_RUN
    with pytest.raises(SchemaError) as info:
        check(registry, "read_file", b'{"path":"a"}', tool_set=[])
    assert info.value.reason is Reason.TOOL_NOT_IN_RUN


def test_good_calls_pass(registry) -> None:
    assert check(registry, "write_file", b'{"path":"src/a.py","content":"x","create_dirs":true}').name == "write_file"
    assert check(registry, "http_request", b'{"method":"GET","url":"https://example.com/x?y=1"}')
    assert check(registry, "run_command", b'{"argv":["git","status"],"timeout_s":5}')


def _write(tmp_path: Path, name: str, schema: dict) -> Path:
    d = tmp_path / "tools"
    d.mkdir(exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps(schema))
    return d


def base(name: str, **extra) -> dict:
    return {"$schema": DIALECT, "title": name, "type": "object",
            "properties": {"path": {"type": "string"}}, "unevaluatedProperties": False, **extra}


LOAD_BAD = [
    # S6: a misspelt keyword would be silently ignored
    ("S6-misspelt", {**base("t"), "additionalProperty": False}),
    ("S6-nested-misspelt", {**base("t"), "properties": {"path": {"type": "string", "maxLenght": 3}}}),
    # S4: the dialect is pinned, never guessed
    ("S4-no-dialect", {k: v for k, v in base("t").items() if k != "$schema"}),
    ("S4-draft7", {**base("t"), "$schema": "http://json-schema.org/draft-07/schema#"}),
    # S5: the root must close the object
    ("S5-open-root", {k: v for k, v in base("t").items() if k != "unevaluatedProperties"}),
    # S3: only same-document $ref
    ("S3-remote-ref", {**base("t"), "properties": {"path": {"$ref": "http://127.0.0.1:1/evil.json"}}}),
    # meta-schema check
    ("meta-bad-type", {**base("t"), "properties": {"path": {"type": "strin"}}}),
    ("meta-bad-minlength", {**base("t"), "properties": {"path": {"type": "string", "minLength": -1}}}),
    ("title-mismatch", {**base("t"), "title": "other"}),
]


@pytest.mark.parametrize(("case", "schema"), LOAD_BAD, ids=[c[0] for c in LOAD_BAD])
def test_bad_schema_refused_at_load(tmp_path, case, schema) -> None:
    with pytest.raises(RegistryLoadError):
        ToolRegistry.load_dir(_write(tmp_path, "t", schema))


def test_S3_remote_ref_is_never_fetched(tmp_path) -> None:
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/evil.json"
        # the server answers: a plain urlopen proves it is reachable
        import urllib.request

        assert urllib.request.urlopen(url, timeout=5).read() == b'{"type": "string"}'
        hits.clear()
        schema = {**base("t"), "properties": {"path": {"$ref": url}}}
        validator = compile_validator(schema)  # past the lint: the registry itself must refuse
        with pytest.raises(referencing.exceptions.Unresolvable):
            list(validator.iter_errors({"path": "x"}))
        # and through the registry check it is a schema failure, not a fetch
        from validator.registry import ToolSpec

        reg = ToolRegistry([ToolSpec("t", schema, validator)])
        with pytest.raises(SchemaInvalid) as info:
            reg.check("t", ["t"], {"path": "x"})
        assert info.value.keyword == "$ref"
        assert hits == []
    finally:
        server.shutdown()
        server.server_close()


def test_empty_schema_dir_refused(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RegistryLoadError):
        ToolRegistry.load_dir(tmp_path / "empty")
