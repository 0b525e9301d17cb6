"""Settings from the environment, and logs that cannot carry content."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest

from callgate.errors import ParseError, Reason
from callgate.logging import Redacted, configure_logging, get_logger
from callgate.settings import DataHandling, Settings

SECRET = "canary-7f3e-secret-content"


def test_settings_from_env_and_secrets_stay_hidden():
    settings = Settings.from_env(
        {
            "CALLGATE_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "CALLGATE_TOPIC_NAMESPACE": "demo",
            "CALLGATE_SIGNING_KEYS": "k1:00ff,k2:abcd",
            "CALLGATE_SIGNING_KEY_ID": "k2",
            "CALLGATE_DATA_HANDLING": "keep",
        }
    )
    assert settings.topics.items == "demo.items"
    assert settings.signing_key() == bytes.fromhex("abcd")
    assert settings.signing_key_map()["k1"] == b"\x00\xff"
    assert settings.data_handling is DataHandling.KEEP
    assert "abcd" not in repr(settings) and "00ff" not in repr(settings)
    with pytest.raises(ValueError):
        Settings.from_env({"CALLGATE_DATA_HANDLING": "sometimes"})


def _log_lines(emit) -> list[dict]:
    stream = io.StringIO()
    configure_logging(stream=stream)
    try:
        emit(get_logger("test"))
    finally:
        configure_logging()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_unknown_keys_and_exception_content_never_reach_the_log():
    def emit(log):
        log.info("decided", run_id="r-1", arguments=SECRET, body={"x": SECRET}, bytes=12)
        buffer = SECRET  # a frame local: structlog would show it with show_locals
        try:
            json.loads("{" + buffer)
        except json.JSONDecodeError:
            log.exception("parse failed")
        try:
            jsonschema.validate(SECRET, {"type": "integer"})
        except jsonschema.ValidationError:
            log.exception("schema failed")
        log.info("wrapped", tool=Redacted(SECRET))
        try:
            raise ParseError(Reason.TRAILING_DATA, "3 bytes after the value")
        except ParseError:
            log.exception("gate")

    lines = _log_lines(emit)
    text = "\n".join(json.dumps(line) for line in lines)
    assert SECRET not in text
    assert lines[0]["run_id"] == "r-1" and lines[0]["bytes"] == 12 and "arguments" not in lines[0]
    assert lines[1]["error_class"] == "JSONDecodeError"
    assert lines[2]["error_class"] == "ValidationError"
    assert lines[3]["tool"] == f"<redacted len={len(SECRET)}>"
    assert lines[4]["reason"] == "trailing_data" and "3 bytes" in lines[4]["error"]
