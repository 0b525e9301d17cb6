"""The `callgate` command line.

Each area registers its own subcommands from its own module, so stages stay
independent: a module in COMMAND_MODULES exposes `register(subparsers)` and
sets `func` (taking the parsed args, returning an exit status) on its parsers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "callgate.cli_topics",
    "callgate.cli_audit",
    "executor.cli",
    "callgate.demo",
    "validator.cli",
    "normalizer.check",
    "ingest.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="callgate", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
