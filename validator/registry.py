"""Tool registry: JSON Schema 2020-12 files, checked and compiled once at load.

Load-time guarantees (see the bad-input catalogue, section 2.2):
- the dialect is pinned: `$schema` must be 2020-12 and `Draft202012Validator`
  is used explicitly (S4), after `check_schema` against its meta-schema;
- every keyword is on an allow-list, so a misspelling such as
  `additionalProperty` fails loudly instead of being ignored (S6);
- the root closes the object (`unevaluatedProperties: false` or
  `additionalProperties: false`) (S5);
- `$ref` may only point inside the same document, and the validator's
  registry is an empty `referencing.Registry()` with no retrieval, so even a
  remote `$ref` that slipped past the lint is unresolvable, never fetched (S3);
- `format` is asserted with `FormatChecker()`; `uri` is really checked
  because jsonschema[format-nongpl] brings rfc3986-validator (S1, S2).

Errors name the failing keyword and the schema path only, never the instance (S11).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import referencing
import referencing.exceptions
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import SchemaError as JsonSchemaSchemaError
from jsonschema.exceptions import best_match

from callgate.errors import Reason, SchemaError

DIALECT = "https://json-schema.org/draft/2020-12/schema"
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas" / "tools"

# keywords whose value is one subschema / a list of them / a name->subschema map
_ONE_SCHEMA = frozenset(
    {"items", "not", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
     "propertyNames", "contains", "if", "then", "else"}
)
_SCHEMA_LIST = frozenset({"prefixItems", "allOf", "anyOf", "oneOf"})
_SCHEMA_MAP = frozenset({"properties", "patternProperties", "$defs", "dependentSchemas"})
_PLAIN = frozenset(
    {"$schema", "$id", "$comment", "$ref", "title", "description", "type", "required", "enum",
     "const", "default", "examples", "format", "minLength", "maxLength", "pattern", "minimum",
     "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
     "uniqueItems", "minContains", "maxContains", "minProperties", "maxProperties",
     "dependentRequired", "readOnly", "writeOnly", "deprecated"}
)
ALLOWED_KEYWORDS = _ONE_SCHEMA | _SCHEMA_LIST | _SCHEMA_MAP | _PLAIN


class RegistryLoadError(Exception):
    """A tool schema file is unusable; the validator refuses to start with it."""


def lint_schema(schema: Any, where: str = "#") -> None:
    """Raise RegistryLoadError on a keyword outside the allow-list or a non-local $ref."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RegistryLoadError(f"{where}: a schema must be an object or a boolean")
    for key, value in schema.items():
        if key not in ALLOWED_KEYWORDS:
            raise RegistryLoadError(f"{where}: keyword {key!r} is not on the allow-list")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise RegistryLoadError(f"{where}: only same-document $ref is allowed")
        if key in _ONE_SCHEMA:
            lint_schema(value, f"{where}/{key}")
        elif key in _SCHEMA_LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                lint_schema(sub, f"{where}/{key}/{i}")
        elif key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                lint_schema(sub, f"{where}/{key}/{name}")


def compile_validator(schema: Mapping[str, Any]) -> Draft202012Validator:
    """The one way callgate builds a validator: pinned dialect, formats asserted, no retrieval."""
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(
        schema, format_checker=FormatChecker(), registry=referencing.Registry()
    )


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    schema: Mapping[str, Any]
    validator: Draft202012Validator


@dataclass(frozen=True, slots=True)
class SchemaFailure:
    keyword: str
    schema_path: str


class SchemaInvalid(SchemaError):
    """SCHEMA_INVALID, carrying the failing keyword and schema path (never the instance)."""

    def __init__(self, failure: SchemaFailure) -> None:
        self.keyword = failure.keyword
        self.schema_path = failure.schema_path
        super().__init__(
            Reason.SCHEMA_INVALID, f"keyword={failure.keyword} schema_path={failure.schema_path}"
        )


class ToolRegistry:
    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self._tools: dict[str, ToolSpec] = {}
        for spec in specs:
            if spec.name in self._tools:
                raise RegistryLoadError(f"tool {spec.name!r} registered twice")
            self._tools[spec.name] = spec

    @classmethod
    def from_schemas(cls, schemas: Mapping[str, Mapping[str, Any]]) -> ToolRegistry:
        return cls(_build_spec(name, schema) for name, schema in schemas.items())

    @classmethod
    def load_dir(cls, directory: Path | str = DEFAULT_SCHEMA_DIR) -> ToolRegistry:
        directory = Path(directory)
        specs = []
        for path in sorted(directory.glob("*.json")):
            try:
                schema = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise RegistryLoadError(f"{path.name}: unreadable ({type(exc).__name__})") from None
            specs.append(_build_spec(path.stem, schema, source=path.name))
        if not specs:
            raise RegistryLoadError(f"no tool schemas in {directory}")
        return cls(specs)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._tools)

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def check(self, tool_name: str, run_tool_set: Iterable[str], args: Mapping[str, Any]) -> ToolSpec:
        """Raise SchemaError unless the tool is registered, in the run's set, and args match."""
        # exact match only: no case folding, no "closest tool" (tool-switching bypass)
        spec = self._tools.get(tool_name)
        if spec is None:
            raise SchemaError(Reason.UNKNOWN_TOOL, f"name of {len(tool_name)} chars not registered")
        if tool_name not in set(run_tool_set):
            raise SchemaError(Reason.TOOL_NOT_IN_RUN, f"tool {tool_name} not in the run's tool set")
        failure = schema_failure(spec, args)
        if failure is not None:
            raise SchemaInvalid(failure)
        return spec


def schema_failure(spec: ToolSpec, args: Mapping[str, Any]) -> SchemaFailure | None:
    try:
        error = best_match(spec.validator.iter_errors(args))
    except referencing.exceptions.Unresolvable:
        return SchemaFailure("$ref", "unresolvable")
    if error is not None:
        # validator + schema_path come from our schema file; message/instance never leave here
        return SchemaFailure(str(error.validator), "/".join(str(p) for p in error.schema_path))
    integral = _float_where_integer(spec.schema, args, "")
    if integral is not None:
        return SchemaFailure("type", integral)
    return None


def _float_where_integer(schema: Any, value: Any, path: str) -> str | None:
    """jsonschema counts 1.0 as an integer (S9); callgate code wants real ints."""
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == "integer" and isinstance(value, float):
        return f"{path}/type".lstrip("/") or "type"
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                found = _float_where_integer(sub, value[name], f"{path}/properties/{name}")
                if found:
                    return found
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            found = _float_where_integer(schema["items"], item, f"{path}/items")
            if found:
                return found
    return None


def _build_spec(name: str, schema: Any, source: str | None = None) -> ToolSpec:
    label = source or name
    if not isinstance(schema, dict):
        raise RegistryLoadError(f"{label}: not a JSON object")
    if schema.get("$schema") != DIALECT:
        raise RegistryLoadError(f"{label}: $schema must be {DIALECT}")
    if schema.get("title", name) != name:
        raise RegistryLoadError(f"{label}: title does not match the tool name")
    if schema.get("type") != "object":
        raise RegistryLoadError(f"{label}: root type must be object")
    if schema.get("unevaluatedProperties") is not False and schema.get("additionalProperties") is not False:
        raise RegistryLoadError(f"{label}: root must set unevaluatedProperties or additionalProperties false")
    lint_schema(schema)
    try:
        validator = compile_validator(schema)
    except JsonSchemaSchemaError as exc:
        raise RegistryLoadError(f"{label}: fails the 2020-12 meta-schema at {exc.validator}") from None
    return ToolSpec(name=name, schema=schema, validator=validator)
