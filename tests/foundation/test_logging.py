"""Logs that cannot carry content: allowlisted keys, no frame locals, no foreign exception messages."""

from __future__ import annotations

import io
import json
import logging

import jsonschema
import pytest

import callgate.logging as callgate_logging
from callgate.errors import ParseError, Reason
from callgate.logging import Redacted, configure_logging, get_logger

SECRET = "canary-7f3e-secret-content"
module_level_log = get_logger("made.at.import")  # like every worker's `log = get_logger(...)`


@pytest.fixture
def capture():
    """Configure logging onto a buffer; give back a reader of the JSON lines; put everything back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()

    def lines() -> list[dict]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    configure_logging(stream=stream)
    try:
        yield lines
    finally:
        callgate_logging._configure_structlog()
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        callgate_logging._stdlib_handler = None
        root.setLevel(level)


def _everything(lines: list[dict]) -> str:
    return "\n".join(json.dumps(line) for line in lines)


def test_only_allowlisted_keys_survive(capture):
    get_logger("test").info(
        "decided", run_id="r-1", bytes=12, arguments=SECRET, body={"x": SECRET}, prompt=SECRET,
        tool={"name": SECRET}, exception=SECRET, stack_info=SECRET,
    )
    (line,) = capture()
    assert SECRET not in _everything([line])
    assert line["event"] == "decided" and line["run_id"] == "r-1" and line["bytes"] == 12
    assert line["logger"] == "test" and line["level"] == "info" and "timestamp" in line
    assert set(line) <= callgate_logging.ALLOWED_FIELDS
    assert line["tool"] == "dict"  # an allowed key with a non-scalar value keeps only the type
    assert "arguments" not in line and "body" not in line and "exception" not in line


def test_redacted_and_long_values(capture):
    log = get_logger("test")
    log.info("wrapped", tool=Redacted(SECRET))
    log.info("long", detail_code=SECRET * 100)
    wrapped, long = capture()
    assert wrapped["tool"] == f"<redacted len={len(SECRET)}>"
    assert repr(Redacted(SECRET.encode())) == f"<redacted len={len(SECRET)}>" and str(Redacted(SECRET)) != SECRET
    assert len(long["detail_code"]) < 300 and long["detail_code"].endswith(f"(+{len(SECRET) * 100 - 256} chars)")


def _parse(buffer: str) -> object:
    raw_args = buffer  # a frame local, which structlog's default traceback rendering would show
    return json.loads("{" + raw_args)


def test_exception_locals_and_foreign_messages_never_reach_the_log(capture):
    log = get_logger("test")
    try:
        _parse(SECRET)
    except json.JSONDecodeError as exc:
        assert SECRET in exc.doc  # the leak channel is real
        log.exception("parse failed", stage="validator")
    try:
        jsonschema.validate(SECRET, {"type": "integer"})
    except jsonschema.ValidationError as exc:
        assert SECRET in str(exc)
        log.exception("schema failed")
    try:
        raise RuntimeError(f"boom with {SECRET}")
    except RuntimeError as exc:
        exc.add_note(f"note with {SECRET}")
        log.error("failed", exc_info=exc)  # an exception object, outside its except block
    parse, schema, runtime = capture()
    assert SECRET not in _everything([parse, schema, runtime])
    assert parse["error_class"] == "JSONDecodeError" and schema["error_class"] == "ValidationError"
    assert runtime["error_class"] == "RuntimeError" and "error" not in runtime
    # the traceback is still there, as code locations
    (stack,) = parse["exception"]
    assert stack["exc_type"] == "JSONDecodeError" and "exc_value" not in stack
    names = [frame["name"] for frame in stack["frames"]]
    assert "test_exception_locals_and_foreign_messages_never_reach_the_log" in names and "_parse" in names
    assert all(set(frame) == {"filename", "lineno", "name"} for frame in stack["frames"])


def test_callgate_errors_keep_their_message_but_not_their_causes(capture):
    try:
        try:
            _parse(SECRET)
        except json.JSONDecodeError as exc:
            raise ParseError(Reason.INVALID_JSON, f"{len(SECRET) + 1} bytes, at char {exc.pos}") from exc
    except ParseError:
        get_logger("test").exception("gate")
    (line,) = capture()
    assert SECRET not in _everything([line])
    assert line["reason"] == "invalid_json" and line["error"] == f"invalid_json: {len(SECRET) + 1} bytes, at char 1"
    outer, cause = line["exception"]
    assert outer["exc_type"] == "ParseError" and outer["exc_value"] == line["error"]
    assert cause["exc_type"] == "JSONDecodeError" and cause["is_cause"] and "exc_value" not in cause


def test_exception_groups_are_scrubbed_member_by_member(capture):
    try:
        raise ExceptionGroup("tasks", [ValueError(SECRET), ParseError(Reason.TRAILING_DATA, "3 bytes")])
    except ExceptionGroup:
        get_logger("test").exception("tasks failed")
    (line,) = capture()
    assert SECRET not in _everything([line])
    (group,) = line["exception"]
    assert group["is_group"]
    members = {inner[0]["exc_type"]: inner[0] for inner in group["exceptions"]}
    assert "exc_value" not in members["ValueError"]
    assert members["ParseError"]["exc_value"] == "trailing_data: 3 bytes"


def test_standard_library_logs_pass_the_same_allowlist(capture):
    library = logging.getLogger("aiokafka.consumer")
    library.warning("fetch failed for %s", SECRET)
    library.info("chatty below the library threshold %s", SECRET)
    try:
        raise OSError(SECRET)
    except OSError:
        library.error("connection lost", exc_info=True)
    warning, error = capture()
    assert SECRET not in _everything([warning, error])
    assert warning["event"] == "fetch failed for %s" and warning["logger"] == "aiokafka.consumer"
    assert warning["level"] == "warning"
    assert error["error_class"] == "OSError" and error["exception"][0]["exc_type"] == "OSError"


def test_loggers_made_at_import_follow_a_later_configuration(capture):
    module_level_log.debug("below the level")
    module_level_log.info("seen", count=1)
    (line,) = capture()
    assert line["logger"] == "made.at.import" and line["count"] == 1
