"""Built-in tools, each confined to the run's workspace.

`run_tool` is the one entry point: it parses the approved (canonical JSON)
arguments and turns every refusal into a FAILED outcome with a Reason, so a
bad call can never crash the worker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from callgate.errors import ExecutionError, Reason
from callgate.states import ItemState
from executor.tools.base import Limits, ToolContext, ToolOutcome
from executor.tools.command import run_command
from executor.tools.files import list_dir, read_file, write_file
from executor.tools.http import http_request

Tool = Callable[[dict[str, Any], ToolContext], ToolOutcome]

TOOLS: dict[str, Tool] = {
    "read_file": read_file,
    "write_file": write_file,
    "list_dir": list_dir,
    "run_command": run_command,
    "http_request": http_request,
}

# Tools whose only effect is what they return: nothing to undo or to reconcile.
SIDE_EFFECT_FREE = frozenset({"read_file", "list_dir"})


def parse_arguments(arguments: bytes) -> dict[str, Any]:
    """The validator already parsed these strictly and signed the canonical bytes."""
    try:
        value = json.loads(arguments.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "arguments not canonical JSON") from None
    if not isinstance(value, dict):
        raise ExecutionError(Reason.SANDBOX_VIOLATION, "arguments not an object")
    return value


def run_tool(tool_name: str, arguments: bytes, ctx: ToolContext) -> ToolOutcome:
    tool = TOOLS.get(tool_name)
    if tool is None:
        return ToolOutcome(ItemState.FAILED, error_class=Reason.UNKNOWN_TOOL.value)
    try:
        return tool(parse_arguments(arguments), ctx)
    except ExecutionError as exc:
        return ToolOutcome(ItemState.FAILED, error_class=exc.reason.value)
    except (KeyError, TypeError, ValueError):
        # a schema/tool mismatch; messages may quote arguments, so only the class leaves
        return ToolOutcome(ItemState.FAILED, error_class=Reason.TOOL_FAILED.value)
    except OSError:
        return ToolOutcome(ItemState.FAILED, error_class=Reason.TOOL_FAILED.value)


__all__ = ["Limits", "SIDE_EFFECT_FREE", "TOOLS", "ToolContext", "ToolOutcome", "parse_arguments", "run_tool"]
