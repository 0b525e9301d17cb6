"""structlog JSON logs that can only carry allowlisted, content-free fields.

An allowlist rather than a denylist: a key nobody thought about (`args`,
`body`, `buffer`...) is dropped, not leaked. Exceptions are rendered without
frame locals (structlog shows them by default, and a local may hold a raw
buffer), and only callgate's own errors keep their message, since those are
built from reasons and sizes by contract; any other exception is reduced to
its type, because `JSONDecodeError.doc` or a jsonschema message embeds input.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from callgate.errors import CallgateError

ALLOWED_FIELDS = frozenset(
    {
        "event", "level", "timestamp", "logger", "stage", "worker_id",
        "run_id", "attempt_id", "response_id", "item_id", "call_id",
        "route", "adapter_version", "tool", "state", "reason", "detail_code",
        "bytes", "count", "seq", "attempt", "partition", "offset", "topic",
        "duration_ms", "status", "http_status", "error_class", "error",
        "partitions", "records", "port", "address", "kills", "phase",
    }
)


class Redacted:
    """Wraps content so that a stray repr shows only its size."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes | str) -> None:
        self._value = value

    @property
    def value(self) -> bytes | str:
        return self._value

    def __repr__(self) -> str:
        return f"<redacted len={len(self._value)}>"

    __str__ = __repr__


def _allowlist(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    exc_info = event_dict.pop("exc_info", None)
    kept = {k: v for k, v in event_dict.items() if k in ALLOWED_FIELDS}
    if exc_info:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if exc is not None:
            kept["error_class"] = type(exc).__name__
            if isinstance(exc, CallgateError):
                kept["reason"] = exc.reason.value
                kept["error"] = str(exc)
    for key, value in list(kept.items()):
        if not isinstance(value, (str, int, float, bool, type(None))):
            kept[key] = repr(value) if isinstance(value, Redacted) else type(value).__name__
    return kept


def configure_logging(level: str = "INFO", stream: TextIO | None = None) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _allowlist,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger().bind(logger=name)


# Unconfigured processes (tests, library use) still get the allowlist.
configure_logging()
