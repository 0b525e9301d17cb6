"""structlog JSON logs that can only carry allowlisted, content-free fields.

An allowlist rather than a denylist: a key nobody thought about (`args`,
`body`, `buffer`...) is dropped, not leaked. Allowed values that are not plain
scalars become their type name (a `Redacted` shows its size), and long strings
are cut, so even an allowed key cannot carry a whole buffer.

Exceptions are rendered as structured tracebacks (type, file, line, function
per frame) with structlog's ExceptionDictTransformer and `show_locals=False`:
structlog shows frame locals by default, and a local may hold a raw buffer.
Only callgate's own errors keep their message, since those are built from
reasons and sizes by contract; every other exception is reduced to its type,
because `JSONDecodeError.doc` or a jsonschema message embeds the input.
Exception notes and SyntaxError source lines are dropped for the same reason.

`configure_logging()` also routes the standard library's `logging` (aiokafka,
httpx) through the same allowlist, keeping a foreign record's message template
but not its arguments. Importing this module configures structlog alone, so a
library user's own logging setup is left as it was.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from callgate.errors import CallgateError

ALLOWED_FIELDS = frozenset(
    {
        "event", "level", "timestamp", "logger", "stage", "worker_id",
        "run_id", "attempt_id", "response_id", "item_id", "call_id",
        "route", "adapter_version", "tool", "state", "reason", "detail_code", "decision",
        "policy_id", "policy_version", "key_id",
        "bytes", "count", "seq", "attempt", "partition", "offset", "topic",
        "duration_ms", "status", "http_status", "exit_code", "error_class", "error", "exception",
        "partitions", "records", "port", "address", "kills", "phase",
    }
)
MAX_STRING = 256  # ids, reasons and messages are short; anything longer is cut

_transform_exception = ExceptionDictTransformer(show_locals=False)
_stdlib_handler: logging.Handler | None = None


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


def _safe_scalar(value: Any) -> Any:
    if isinstance(value, Redacted):
        return repr(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else f"{value[:MAX_STRING]}...(+{len(value) - MAX_STRING} chars)"
    if isinstance(value, (bool, int, float, type(None))):
        return value
    return type(value).__name__


def _allowlist(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    exc_info = event_dict.get("exc_info")
    kept = {k: _safe_scalar(v) for k, v in event_dict.items() if k in ALLOWED_FIELDS and k != "exception"}
    if exc_info:
        kept["exc_info"] = exc_info  # rendered by _render_exception, which runs next
    return kept


def _exc_info_tuple(exc_info: Any) -> tuple[type[BaseException], BaseException, TracebackType | None] | None:
    if isinstance(exc_info, BaseException):
        return type(exc_info), exc_info, exc_info.__traceback__
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and exc_info[1] is not None:
        return exc_info
    current = sys.exc_info()
    return current if current[1] is not None else None


def _safe_messages(root: BaseException) -> set[tuple[str, str]]:
    """(type name, message) of every CallgateError reachable from root: the only messages allowed out."""
    safe: set[tuple[str, str]] = set()
    seen: set[int] = set()
    todo = [root]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, CallgateError):
            safe.add((type(exc).__name__, str(exc)))
        todo.extend((exc.__cause__, exc.__context__))
        todo.extend(getattr(exc, "exceptions", ()))
    return safe


def _safe_stacks(stacks: list[dict[str, Any]], safe: set[tuple[str, str]]) -> list[dict[str, Any]]:
    out = []
    for stack in stacks:
        clean: dict[str, Any] = {
            "exc_type": stack["exc_type"],
            "is_cause": stack.get("is_cause", False),
            "frames": [{k: f[k] for k in ("filename", "lineno", "name") if k in f} for f in stack["frames"]],
        }
        if (stack["exc_type"], stack.get("exc_value")) in safe:
            clean["exc_value"] = _safe_scalar(stack["exc_value"])
        if stack.get("is_group"):
            clean["is_group"] = True
            clean["exceptions"] = [_safe_stacks(inner, safe) for inner in stack.get("exceptions", ())]
        out.append(clean)
    return out


def _render_exception(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    exc_info = _exc_info_tuple(event_dict.pop("exc_info", None)) if "exc_info" in event_dict else None
    if exc_info is None:
        return event_dict
    exc = exc_info[1]
    event_dict["error_class"] = type(exc).__name__
    if isinstance(exc, CallgateError):
        event_dict["reason"] = exc.reason.value
        event_dict["error"] = _safe_scalar(str(exc))
    try:
        event_dict["exception"] = _safe_stacks(_transform_exception(exc_info), _safe_messages(exc))
    except Exception:  # noqa: BLE001 - a log line must never raise; keep the class name
        event_dict["exception"] = [{"exc_type": type(exc).__name__, "frames": []}]
    return event_dict


def _logger_name(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    name = event_dict.pop(_NAME_KEY, None)
    if name is not None:
        event_dict["logger"] = name
    return event_dict


def _from_stdlib(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    record = event_dict.get("_record")
    if record is not None:
        event_dict["logger"] = record.name
    return event_dict


_NAME_KEY = "logger_name"
_TIMESTAMPER = structlog.processors.TimeStamper(fmt="iso", utc=True)
_TAIL = [_logger_name, _allowlist, _render_exception]


def configure_logging(level: str = "INFO", stream: TextIO | None = None, *, stdlib_level: str = "WARNING") -> None:
    """JSON lines on `stream` (stderr): callgate's own logs at `level`, other libraries' at `stdlib_level`."""
    global _stdlib_handler
    _configure_structlog(level, stream)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[_from_stdlib, structlog.processors.add_log_level, _TIMESTAMPER],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *_TAIL,
                structlog.processors.JSONRenderer(),
            ],
            use_get_message=False,  # the message template only: its arguments may be content
        )
    )
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    root.setLevel(stdlib_level.upper())
    _stdlib_handler = handler


def _configure_structlog(level: str = "INFO", stream: TextIO | None = None) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _TIMESTAMPER,
            *_TAIL,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    """A lazy logger: it follows whatever configure_logging() set last, even when made at import time."""
    # `logger` itself cannot be an initial value (wrap_logger takes a parameter of that name)
    return structlog.get_logger(**{_NAME_KEY: name})


# Unconfigured processes (tests, library use) still get the allowlist.
_configure_structlog()
