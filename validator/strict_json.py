"""Strict parse of a terminal argument buffer as exactly one JSON object.

One parser (stdlib `json`, strict mode, with hooks) reads the *complete*
buffer after the provider's terminal event. Every way the bytes can fail has
its own `Reason`; the `ParseError` carries sizes and offsets only, never the
buffer (a `JSONDecodeError` keeps the whole document in `.doc`, so it is
never chained onto what we raise).

The result is an immutable tree (`FrozenDict` / `FrozenList`, which are still
`dict` / `list` so jsonschema's type checks hold) plus its canonical bytes
(`callgate.signing.canonical_json`): downstream code validates, signs and
executes those bytes, never the model's original text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NoReturn

from callgate.errors import ParseError, Reason
from callgate.signing import canonical_json

MAX_BUFFER_BYTES = 1 << 20
MAX_DEPTH = 64
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# 19 digits hold every int64; a sign adds one character
_MAX_INT_CHARS = 20
_JSON_WHITESPACE = " \t\n\r"


class _Immutable(TypeError):
    pass


def _refuse(*_args: object, **_kwargs: object) -> NoReturn:
    raise _Immutable("parsed arguments are immutable")


class FrozenDict(dict):  # type: ignore[type-arg]
    """A dict that refuses mutation: the validated form is the executed form."""

    __slots__ = ()
    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        raise TypeError("unhashable type: FrozenDict")


class FrozenList(list):  # type: ignore[type-arg]
    __slots__ = ()
    __setitem__ = __delitem__ = _refuse  # type: ignore[assignment]
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse  # type: ignore[assignment]
    __iadd__ = __imul__ = _refuse  # type: ignore[assignment]


def thaw(value: Any) -> Any:
    """A plain mutable copy (for code that must build a modified form, e.g. policy rewrites)."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [thaw(v) for v in value]
    return value


def freeze(value: Any) -> Any:
    if isinstance(value, FrozenDict | FrozenList):
        return value
    if isinstance(value, dict):
        return FrozenDict((k, freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return FrozenList(freeze(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class ParsedArgs:
    value: FrozenDict
    canonical: bytes
    byte_count: int  # of the original buffer


class _Reject(Exception):
    """Raised from inside the json hooks; carries only a reason and a safe detail."""

    def __init__(self, reason: Reason, detail: str) -> None:
        self.reason = reason
        self.detail = detail


def _object_pairs(pairs: list[tuple[str, Any]]) -> FrozenDict:
    obj = FrozenDict((k, _freeze_list(v) if type(v) is list else v) for k, v in pairs)
    if len(obj) != len(pairs):
        raise _Reject(Reason.DUPLICATE_KEY, f"object with {len(pairs)} members repeats a name")
    return obj


def _freeze_list(items: list[Any]) -> FrozenList:
    # dicts are already frozen by the pairs hook; only arrays need a walk
    return FrozenList(_freeze_list(v) if type(v) is list else v for v in items)


def _parse_constant(name: str) -> NoReturn:
    raise _Reject(Reason.NON_FINITE_NUMBER, "NaN or Infinity literal")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject(Reason.NON_FINITE_NUMBER, f"number of {len(text)} chars overflows a double")
    return value


def _parse_int(text: str) -> int:
    # length first: int() on 4300+ digits raises ValueError, and big ints cost CPU
    if len(text) > _MAX_INT_CHARS:
        raise _Reject(Reason.INTEGER_OUT_OF_RANGE, f"integer of {len(text)} chars")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _Reject(Reason.INTEGER_OUT_OF_RANGE, f"integer of {len(text)} chars outside int64")
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=_object_pairs,
    parse_constant=_parse_constant,
    parse_float=_parse_float,
    parse_int=_parse_int,
    strict=True,
)

# A string token, or an unterminated one running to the end: never backtracks
# quadratically, and leaves only structure outside strings.
_STRING_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def nesting_depth(text: str) -> int:
    """Maximum bracket depth outside strings, without recursion."""
    brackets = _NOT_BRACKET.sub("", _STRING_TOKEN.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(1 if c in "[{" else -1 for c in brackets))


def parse_arguments(
    buffer: bytes, *, max_bytes: int = MAX_BUFFER_BYTES, max_depth: int = MAX_DEPTH
) -> ParsedArgs:
    """Parse the complete buffer; raise ParseError with a distinct Reason on any defect."""
    size = len(buffer)
    if size > max_bytes:
        raise ParseError(Reason.BUFFER_TOO_LARGE, f"bytes={size} limit={max_bytes}")
    if size == 0:
        raise ParseError(Reason.EMPTY_BUFFER, "bytes=0")
    failure: tuple[Reason, str] | None = None
    try:
        # decode ourselves: json.loads(bytes) would strip a BOM and guess UTF-16/32
        text = buffer.decode("utf-8", "strict")
    except UnicodeDecodeError as exc:
        failure = (Reason.NOT_UTF8, f"bad byte at offset {exc.start}")
    if failure is not None:
        raise ParseError(*failure)
    if text.startswith("\ufeff"):
        raise ParseError(Reason.BOM_PRESENT, "leading U+FEFF")
    if not text.strip(_JSON_WHITESPACE):
        raise ParseError(Reason.EMPTY_BUFFER, f"bytes={size} all whitespace")
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ParseError(Reason.NESTING_TOO_DEEP, f"depth>{max_depth}")

    value: Any = None
    try:
        # decode() = raw_decode + an end check, on the complete buffer
        value = _DECODER.decode(text)
    except _Reject as exc:
        failure = (exc.reason, exc.detail)
    except json.JSONDecodeError as exc:
        # exc.msg is the parser's fixed wording; exc.doc is the raw input and stays here
        if exc.msg == "Extra data":
            failure = (Reason.TRAILING_DATA, f"non-whitespace after char {exc.pos} of {len(text)}")
        else:
            failure = (Reason.INVALID_JSON, f"{exc.msg} (char {exc.pos})")
    except RecursionError:
        failure = (Reason.NESTING_TOO_DEEP, "recursion limit")
    except ValueError:
        # int() limits (CVE-2020-10735) raise a bare ValueError, not JSONDecodeError
        failure = (Reason.INTEGER_OUT_OF_RANGE, "integer conversion limit")
    if failure is not None:
        raise ParseError(*failure)

    if not isinstance(value, dict):
        raise ParseError(Reason.NOT_AN_OBJECT, f"top level is {_json_type(value)}")
    try:
        # strict UTF-8 encoding of the whole tree finds every lone surrogate, keys included
        canonical = canonical_json(value)
    except UnicodeEncodeError:
        failure = (Reason.LONE_SURROGATE, "string holds an unpaired surrogate")
    except ValueError:
        failure = (Reason.NON_FINITE_NUMBER, "non-finite number")
    if failure is not None:
        raise ParseError(*failure)
    return ParsedArgs(value=value, canonical=canonical, byte_count=size)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
