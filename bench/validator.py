"""Validated calls per second for a typical write_file call (run on demand).

    .venv/bin/python bench/validator.py [--seconds 2]

Compares, in the same run:
- callgate: the full validator core (strict parse, registry with validators
  compiled once at load, policy with path canonicalisation and realpath);
- compiled schema only: strict parse + the precompiled validator (no policy);
- naive baseline: json.loads + jsonschema.validate, which builds a new
  validator (and re-checks the schema) on every call.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# this file is called validator.py: keep its own directory from shadowing the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import jsonschema  # noqa: E402

from callgate.records import TerminalItem
from validator.core import Approved, RunState, Validator
from validator.policy import PolicySet, policy_from_mapping
from validator.registry import DEFAULT_SCHEMA_DIR, ToolRegistry
from validator.strict_json import parse_arguments  # noqa: E402

CONTENT = "def main():\n    print('hello, world')\n\n" * 20  # ~800 bytes of source


def rate(fn, seconds: float) -> float:
    n, started = 0, time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(200):
            fn()
        n += 200
        now = time.perf_counter()
        if now >= deadline:
            return n / (now - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()

    workspace = Path(tempfile.mkdtemp(prefix="callgate-bench-"))
    (workspace / "src").mkdir()
    policy = policy_from_mapping(
        {"policy": {"id": "bench", "version": "1", "workspace_root": str(workspace),
                    "max_calls_per_run": 10**12}},
        base_dir=workspace,
    )
    registry = ToolRegistry.load_dir()
    validator = Validator(registry, PolicySet([policy]))
    raw = json.dumps({"path": "src/app.py", "content": CONTENT, "create_dirs": False}).encode()
    item = TerminalItem(
        run_id="run", attempt_id="a", response_id="r", item_id="i", call_id="c", provider_call_id=None,
        tool_name="write_file", arguments=raw, route="bench", adapter_version="1",
        provider_event="response.output_item.done", tool_set=["write_file"], policy_id="bench", terminal_at=0,
    )
    state = RunState("run")
    assert isinstance(validator.decide(item, state), Approved)
    schema = json.loads((DEFAULT_SCHEMA_DIR / "write_file.json").read_text())
    spec = registry.get("write_file")
    assert spec is not None

    def full() -> None:
        validator.decide(item, state)

    def compiled_only() -> None:
        spec.validator.validate(parse_arguments(raw).value)

    def naive() -> None:
        jsonschema.validate(json.loads(raw), schema)

    results = {
        "callgate full pipeline (parse+schema+policy)": rate(full, args.seconds),
        "strict parse + compiled schema": rate(compiled_only, args.seconds),
        "naive json.loads + jsonschema.validate": rate(naive, args.seconds),
    }
    print(f"write_file call, {len(raw)} bytes of arguments")
    for name, value in results.items():
        print(f"  {name:48} {value:10,.0f} calls/s")
    baseline = results["naive json.loads + jsonschema.validate"]
    print(f"  ratio compiled/naive: {results['strict parse + compiled schema'] / baseline:.1f}x, "
          f"full/naive: {results['callgate full pipeline (parse+schema+policy)'] / baseline:.1f}x")


if __name__ == "__main__":
    main()
