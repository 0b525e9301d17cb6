"""`callgate demo`: the pipeline end to end on the shipped fixtures.

Starts a local upstream serving `fixtures/`, the four workers as real
processes, submits one run per fixture (every route: good calls, parallel
calls, every fault), answers the calls that wait for a person through the
real `callgate approve` / `callgate deny` commands, waits for everything to
settle, and prints each item's final state and reason from the audit topic.
Exit status 0 when every item ended as its fixture expects.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from callgate.pipeline import ExpectedItem, Outcome, Pipeline, load_fixture_specs
from callgate.settings import Settings
from callgate.states import ItemState


class ProgressBar:
    def __init__(self, label: str, stream=sys.stderr, width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.started = time.monotonic()
        self._last = ""

    def __call__(self, done: int, total: int) -> None:
        filled = int(self.width * done / total) if total else self.width
        bar = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} runs"
        if self.stream.isatty():
            self.stream.write(f"\r{bar} {time.monotonic() - self.started:5.1f}s")
        elif bar != self._last:  # a log file gets one line per step, not a redraw per poll
            self.stream.write(f"{bar} {time.monotonic() - self.started:5.1f}s\n")
        self._last = bar
        self.stream.flush()

    def finish(self) -> None:
        if self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


def _meets(want: ExpectedItem, outcome: Outcome, item) -> bool:
    """Does the pipeline's final state honour what the gate was expected to decide?

    Fixture expectations state the gate's decision (what `callgate check`
    prints). Downstream, an approved call goes on to the executor, and a call
    that waited for a person ends as that person decided.
    """
    state, reason = outcome.final_of(item)
    if want.state == ItemState.POLICY_APPROVED.value:
        return state in (ItemState.EXECUTED.value, ItemState.FAILED.value)
    if want.state == ItemState.PENDING_APPROVAL.value:
        asked = any(s.state == ItemState.PENDING_APPROVAL.value for s in item.steps)
        answered = state in (ItemState.EXECUTED.value, ItemState.FAILED.value) or (
            state == ItemState.REJECTED.value and reason == "approval_denied")
        return asked and answered
    return state == want.state and (want.reason or None) == (reason or None)


def _match(outcome: Outcome) -> list[tuple[object | None, ExpectedItem | None]]:
    """Pair expected items with observed ones by provider item id, in order (attempts repeat ids)."""
    observed = list(outcome.timeline.items)
    pairs: list[tuple[object | None, ExpectedItem | None]] = []
    for want in outcome.spec.expected or ():
        found = next((i for i in observed if want.item_id is None or i.item_id == want.item_id), None)
        if found is not None:
            observed.remove(found)
        pairs.append((found, want))
    pairs.extend((item, None) for item in observed)  # items nobody expected
    return pairs


def _rows(outcomes: list[Outcome]) -> tuple[list[tuple[str, ...]], Counter, int]:
    rows: list[tuple[str, ...]] = []
    totals: Counter = Counter()
    mismatches = 0
    for outcome in sorted(outcomes, key=lambda o: o.spec.label):
        for item, want in _match(outcome):
            if item is None:
                mismatches += 1
                rows.append((outcome.spec.label, want.item_id or "-", "-", "MISSING", "",
                             f"expected {want.state} {want.reason or ''}".rstrip()))
                continue
            state, reason = outcome.final_of(item)
            totals[state] += 1
            ok = want is not None and _meets(want, outcome, item)
            mismatches += not ok
            check = "ok" if ok else (f"expected {want.state} {want.reason or ''}".rstrip() if want else "unexpected")
            rows.append((outcome.spec.label, item.item_id or "-", item.tool or "-", state, reason or "", check))
    return rows, totals, mismatches


def _print_table(rows: list[tuple[str, ...]]) -> None:
    header = ("run", "item", "tool", "final state", "reason", "check")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _answer_pending(pipeline: Pipeline, outcomes: list[Outcome]) -> int:
    """Answer each waiting call as a person would: approve commands, deny network access."""
    answered = 0
    env = {**os.environ, **pipeline.env()}
    for outcome in outcomes:
        for item in outcome.timeline.items:
            if outcome.final_of(item)[0] != ItemState.PENDING_APPROVAL.value or item.call_id is None:
                continue
            if item.tool == "run_command":
                command = ["approve", item.call_id, "--by", "demo-operator"]
            else:
                command = ["deny", item.call_id, "--why", "no network access from the demo"]
            subprocess.run([sys.executable, "-m", "callgate", *command, "--namespace", pipeline.namespace],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            answered += 1
    return answered


async def run_demo(bootstrap: str, work_dir: Path, *, timeout_s: float) -> int:
    specs = load_fixture_specs()
    if not specs:
        print("no fixtures with expectations found under fixtures/", file=sys.stderr)
        return 1
    async with Pipeline(bootstrap=bootstrap, work_dir=work_dir) as pipeline:
        print(f"broker {bootstrap}, topics {pipeline.namespace}.*, "
              f"workers: {', '.join(w.name for w in pipeline.fleet.workers)}", file=sys.stderr)
        for spec in specs:
            await pipeline.submit(spec)
        print(f"submitted {len(specs)} runs across routes "
              f"{', '.join(sorted({s.route for s in specs}))}", file=sys.stderr)
        bar = ProgressBar("settling")
        outcomes = await pipeline.settle(timeout_s=timeout_s, on_progress=bar)
        bar.finish()
        answered = _answer_pending(pipeline, outcomes)
        if answered:
            print(f"answered {answered} approval requests (approve run_command, deny network)", file=sys.stderr)

            def answered_all() -> bool:
                return not any(o.final_of(i)[0] == ItemState.PENDING_APPROVAL.value
                               for o in pipeline.outcomes() for i in o.timeline.items)

            deadline = time.monotonic() + timeout_s
            while not answered_all():
                if time.monotonic() > deadline:
                    raise TimeoutError("approved calls did not finish")
                await asyncio.sleep(0.2)  # polling the audit follower with a deadline
            outcomes = pipeline.outcomes()
    rows, totals, mismatches = _rows(outcomes)
    _print_table(rows)
    print()
    print("totals: " + ", ".join(f"{state} {count}" for state, count in sorted(totals.items()))
          + f"  ({sum(totals.values())} items in {len(outcomes)} runs)")
    if mismatches:
        print(f"{mismatches} items differ from their fixture's expectation", file=sys.stderr)
        return 1
    print("every item ended as its fixture expects; nothing unsafe reached the executor")
    return 0


def _demo(args: argparse.Namespace) -> int:
    # aiokafka warns while a just-created topic elects its leaders; the demo's own output is the point
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    settings = Settings.from_env()
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="callgate-demo-"))
    try:
        return asyncio.run(run_demo(args.bootstrap or settings.kafka_bootstrap, work_dir, timeout_s=args.timeout))
    finally:
        if args.keep or args.work_dir:
            print(f"work directory (workspaces, policies, worker logs): {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run the pipeline end to end on the shipped fixtures")
    demo.add_argument("--bootstrap", help="Kafka bootstrap address (default: CALLGATE_KAFKA_BOOTSTRAP)")
    demo.add_argument("--work-dir", help="where workspaces, policies and worker logs go (default: a temp dir)")
    demo.add_argument("--keep", action="store_true", help="keep the temp work dir (worker logs) afterwards")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the runs to settle")
    demo.set_defaults(func=_demo)
