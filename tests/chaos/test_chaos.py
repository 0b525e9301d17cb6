"""Chaos: the whole pipeline under SIGKILLs, partition moves and a broker restart, then conservation.

Many runs (variants of the shipped fixtures: every route, parallel calls, every
fault fixture; plus per-run write_file calls whose targets are unique, so their
side effects can be counted on disk) go through all four workers, real
processes against a broker of the test's own (it gets restarted). Meanwhile a
random worker is SIGKILLed at random moments and started again, a second
instance of a stage joins and leaves (its partitions move there and back), and
the broker is stopped and started on its kept data once.

Afterwards, from the topics (read_committed, decoded with callgate.avro), the
ledger and the workspace:
- every item that entered ends in exactly one final state (or waits for a
  person, when the policy asks for one), and as its fixture allows;
- no item is lost: every expected item of every run is there;
- nothing invalid is approved: every approved record belongs to an item its
  fixture expects to be approved, and its signature verifies;
- no approved call ran twice: one approval, one result, one settled ledger
  entry per call id, and no more renames onto a write_file target than calls
  that were approved to write it (inotify, counted from outside the executor).

Chaos moves the transport, so some runs are streamed again by ingest (it is
at-least-once; a new attempt supersedes the old one): an item of an extra
attempt may end QUARANTINED, or as its fixture says. The last attempt of every
run must match its fixture exactly; quarantine reasons are not compared
(they depend on where the transport was cut), rejection reasons are.

CALLGATE_CHAOS=bounded (what dev/test sets) runs the small plan; the long
soak is `dev/test -m slow tests/chaos` (or CALLGATE_CHAOS=long for the
unmarked test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import inotify_simple
import pytest

from callgate import avro
from callgate.broker import LocalBroker, free_port
from callgate.kafka import read_topic
from callgate.pipeline import FIXTURES_ROOT, STAGES, ExpectedItem, Outcome, Pipeline, RunSpec, load_fixture_specs
from callgate.records import ApprovedCall, AuditRecord, LedgerEntry, TerminalItem, ToolResult
from callgate.settings import Settings
from callgate.signing import verify
from callgate.states import FINAL_STATES, ItemState
from callgate.supervise import WorkerProcess

pytestmark = pytest.mark.kafka

APPROVED_FINALS = {ItemState.EXECUTED.value, ItemState.FAILED.value, ItemState.IN_DOUBT.value}
PENDING = ItemState.PENDING_APPROVAL.value
QUARANTINED = ItemState.QUARANTINED.value
CHAOS_DIR = "chaos"  # write_file targets unique per run live here, in the demo workspace


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    runs: int
    kills: int
    partition_moves: int
    broker_restarts: int
    submit_gap_s: float  # mean pause between submissions
    settle_timeout_s: float
    seed: int


BOUNDED = ChaosPlan(runs=80, kills=8, partition_moves=1, broker_restarts=1, submit_gap_s=0.4,
                    settle_timeout_s=150, seed=8)
LONG = ChaosPlan(runs=500, kills=40, partition_moves=4, broker_restarts=1, submit_gap_s=0.15,
                 settle_timeout_s=900, seed=88)


# ------------------------------------------------------------------ workload


@dataclass(slots=True)
class Workload:
    specs: list[RunSpec]
    unique_targets: dict[str, str] = field(default_factory=dict)  # label -> write_file path (workspace-relative)


def _variant_options(rng: random.Random, spec: RunSpec) -> tuple[tuple[str, str], ...]:
    options = {"chunk": str(rng.choice([0, 0, 16, 61, 256])), "delay_ms": str(rng.choice([0, 0, 0, 1]))}
    if len(spec.attempts) == 1 and rng.random() < 0.2:
        # a 429 before anything streams: ingest retries it as a second attempt (Retry-After 0)
        options.update(fail_first="1", status="429", retry_after="0")
    options.update(dict(spec.upstream_options))  # the fixture's own options win
    return tuple(sorted(options.items()))


def build_workload(rng: random.Random, fixtures: Path, n_runs: int) -> Workload:
    """n_runs variants: shipped fixtures with chunking/429s, and unique-target write_file runs."""
    shipped = [s for s in load_fixture_specs(fixtures) if s.expected]
    assert shipped, f"no fixtures with expectations under {fixtures}"
    writers = [s for s in shipped if s.label.endswith("/good_write_file")]
    assert writers, "the unique-target runs are made from the good_write_file fixtures"
    workload = Workload(specs=[])
    for index in range(n_runs):
        if rng.random() < 0.35:
            template = rng.choice(writers)
            route_dir, name = template.attempts[0].split("/", 1)
            source = (fixtures / template.attempts[0]).read_text()
            original = "notes/todo.md"
            assert original in source, template.label
            target = f"{CHAOS_DIR}/w{index:04d}-{uuid.uuid4().hex[:8]}.md"
            path = f"{route_dir}/chaos-{index:04d}.sse"
            (fixtures / path).write_text(source.replace(original, target))
            label = f"{template.label}#{index}"
            spec = RunSpec(label, template.route, (path,), template.tool_set, template.policy_id,
                           template.expected, ())
            workload.unique_targets[label] = target
        else:
            template = rng.choice(shipped)
            spec = RunSpec(f"{template.label}#{index}", template.route, template.attempts, template.tool_set,
                           template.policy_id, template.expected, ())
        workload.specs.append(
            RunSpec(spec.label, spec.route, spec.attempts, spec.tool_set, spec.policy_id, spec.expected,
                    _variant_options(rng, template))
        )
    return workload


# ------------------------------------------------------------------ chaos


@dataclass(slots=True)
class ChaosLog:
    kills: Counter = field(default_factory=Counter)  # per stage
    restarts: int = 0  # workers started again after a kill
    crash_restarts: list[tuple[str, float]] = field(default_factory=list)  # (worker, monotonic) exits we did not cause
    partition_moves: list[str] = field(default_factory=list)
    broker_restarts: int = 0
    broker_down: tuple[float, float] | None = None  # monotonic window, stop..ready


class Chaos:
    def __init__(self, pipeline: Pipeline, broker: LocalBroker, plan: ChaosPlan, rng: random.Random) -> None:
        self.pipeline = pipeline
        self.broker = broker
        self.plan = plan
        self.rng = rng
        self.log = ChaosLog()
        self.broker_up = asyncio.Event()
        self.broker_up.set()
        self._extra_index: Counter = Counter()

    def _stage_workers(self, stage: str) -> list[WorkerProcess]:
        return [w for w in self.pipeline.fleet.workers if w.stage == stage and w.running]

    async def kill_one(self, stage: str) -> None:
        workers = self._stage_workers(stage)
        if not workers:
            return
        worker = self.rng.choice(workers)
        await asyncio.to_thread(worker.kill)
        self.log.kills[stage] += 1
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))  # down for a random while: part of the chaos
        worker.start()
        self.log.restarts += 1

    async def move_partitions(self, stage: str) -> None:
        self._extra_index[stage] += 1
        extra = self.pipeline.add_worker(stage, self._extra_index[stage])
        extra.start()
        self.log.partition_moves.append(stage)
        await asyncio.sleep(self.rng.uniform(3.0, 7.0))  # the second instance works for a random while
        await asyncio.to_thread(extra.stop)  # its partitions move back to the first instance

    async def restart_broker(self) -> None:
        self.broker_up.clear()
        began = time.monotonic()
        await asyncio.to_thread(self.broker.stop)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # the broker is away for a random while
        await asyncio.to_thread(self.broker.start, fresh=False)
        self.log.broker_restarts += 1
        self.log.broker_down = (began, time.monotonic())
        self.broker_up.set()

    async def run(self) -> None:
        plan = self.plan
        stages = [STAGES[i % len(STAGES)] for i in range(plan.kills)]
        self.rng.shuffle(stages)
        actions: list[tuple[str, str]] = [("kill", s) for s in stages]
        movable = ["normalizer", "validator", "executor", "ingest"]
        actions += [("move", movable[i % len(movable)]) for i in range(plan.partition_moves)]
        self.rng.shuffle(actions)
        # the broker goes away once the pipeline is busy, somewhere in the middle third
        for _ in range(plan.broker_restarts):
            actions.insert(self.rng.randrange(len(actions) // 3, 2 * len(actions) // 3 + 1), ("broker", ""))
        for kind, stage in actions:
            await asyncio.sleep(self.rng.uniform(0.8, 3.5))  # a random moment, not a synchronisation
            if kind == "kill":
                await self.kill_one(stage)
            elif kind == "move":
                await self.move_partitions(stage)
            else:
                await self.restart_broker()

    def restart_crashed(self) -> None:
        """A worker that exited on its own is started again, as its supervisor would; we note when."""
        for worker in self.pipeline.fleet.dead():
            self.log.crash_restarts.append((worker.name, time.monotonic()))
            worker.start()


async def _submit_all(pipeline: Pipeline, chaos: Chaos, specs: list[RunSpec], rng: random.Random,
                      gap_s: float) -> None:
    for spec in specs:
        while True:
            await chaos.broker_up.wait()
            try:
                await asyncio.wait_for(pipeline.submit(spec), timeout=30)
                break
            except Exception:  # noqa: BLE001 - the broker went away under the send: send it again
                await asyncio.sleep(0.5)  # backoff before retrying the broker
        await asyncio.sleep(rng.expovariate(1.0 / gap_s))  # offered load, not synchronisation


async def _settle(pipeline: Pipeline, chaos: Chaos, timeout_s: float) -> list[Outcome]:
    deadline = time.monotonic() + timeout_s
    while True:
        chaos.restart_crashed()
        outcomes = pipeline.outcomes()
        if all(o.settled for o in outcomes):
            return outcomes
        if time.monotonic() > deadline:
            stragglers = [o.spec.label for o in outcomes if not o.settled]
            raise TimeoutError(f"{len(stragglers)} runs not settled: {', '.join(stragglers[:10])}; "
                               f"logs in {pipeline.work_dir / 'logs'}")
        await asyncio.sleep(0.2)  # polling the audit follower under a deadline


# ------------------------------------------------------------------ disk


class RenameWatch:
    """inotify on one directory: write_file ends each execution with one rename of a unique temp file onto its target.

    The rename is counted by its IN_MOVED_FROM event, whose name (the temp file,
    `.<target>.<16 hex>.callgate-tmp`) is unique per execution. IN_MOVED_TO would
    name the target, and the kernel merges consecutive identical unread events
    (it does not compare rename cookies), so two writes of one target in quick
    succession would count as one.
    """

    _TEMP = re.compile(r"^\.(?P<target>.+)\.[0-9a-f]{16}\.callgate-tmp$")

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inotify = inotify_simple.INotify()
        self._inotify.add_watch(directory, inotify_simple.flags.MOVED_FROM)
        self.counts: Counter = Counter()
        self.overflowed = False

    def drain(self) -> Counter:
        while events := self._inotify.read(timeout=0):
            for event in events:
                if event.mask & inotify_simple.flags.Q_OVERFLOW:
                    self.overflowed = True
                elif event.mask & inotify_simple.flags.MOVED_FROM and (match := self._TEMP.match(event.name)):
                    self.counts[match["target"]] += 1
        return self.counts

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._inotify.close()


# ------------------------------------------------------------------ conservation


def _allowed_finals(expected: ExpectedItem) -> set[str]:
    if expected.state == ItemState.POLICY_APPROVED.value:
        return APPROVED_FINALS
    if expected.state == ItemState.EXECUTED.value:
        return {ItemState.EXECUTED.value, ItemState.IN_DOUBT.value}
    return {expected.state}


# per run label, from the fixture's expectation file: (item id, expectation) and the attempt of each
_EXPECT_ITEMS: dict[str, list[tuple[str, ExpectedItem]]] = {}
_EXPECT_ATTEMPTS: dict[str, list[int]] = {}


def _attach_item_ids(specs: list[RunSpec], fixtures: Path) -> None:
    for spec in specs:
        template = spec.label.split("#", 1)[0]
        expect = json.loads((fixtures / f"{template}.expect.json").read_text())
        _EXPECT_ITEMS[spec.label] = [
            (str(item.get("item_id", index)), ExpectedItem(item["state"], item.get("reason")))
            for index, item in enumerate(expect.get("items", []))
        ]
        _EXPECT_ATTEMPTS[spec.label] = [int(item.get("attempt", 1)) for item in expect.get("items", [])]



@dataclass(slots=True)
class Figures:
    runs: int = 0
    items: int = 0
    extra_attempt_items: int = 0
    final_states: Counter = field(default_factory=Counter)
    approved: int = 0
    results: int = 0
    unique_writes_executed: int = 0
    problems: list[str] = field(default_factory=list)


async def conservation(pipeline: Pipeline, outcomes: list[Outcome], workload: Workload,
                       renames: RenameWatch) -> Figures:
    bootstrap = pipeline.bootstrap
    topics = pipeline.topics
    figures = Figures(runs=len(outcomes))
    problems = figures.problems

    async def decoded(topic: str) -> list:
        return [avro.decode(r.value, topic=r.topic, partition=r.partition, offset=r.offset)
                for r in await read_topic(bootstrap, topic, timeout_s=90)]

    audit = [r for r in await decoded(topics.audit) if isinstance(r, AuditRecord)]
    terminal = [r for r in await decoded(topics.items) if isinstance(r, TerminalItem)]
    approved = [r for r in await decoded(topics.calls_approved) if isinstance(r, ApprovedCall)]
    results = [r for r in await decoded(topics.results) if isinstance(r, ToolResult)]
    ledger_entries = [r for r in await decoded(topics.ledger) if isinstance(r, LedgerEntry)]
    keys = Settings.from_env(pipeline.env()).signing_key_map()

    # every item of every run: exactly one final state, allowed by its fixture; the last attempt exact
    item_of_call: dict[str, tuple[str, str]] = {}  # call id -> (run label, fixture item id)
    final_of_call: dict[str, str] = {}
    for outcome in outcomes:
        spec = outcome.spec
        expected = _EXPECT_ITEMS[spec.label]
        wanted = defaultdict(set)
        for item_id, exp, *_ in expected:
            wanted[item_id] |= _allowed_finals(exp)
        attempts: dict[str, list] = defaultdict(list)
        for item in outcome.timeline.items:
            attempts[item.attempt_id].append(item)
        order = sorted(attempts, key=lambda a: min(s.observed_at for i in attempts[a] for s in i.steps))
        figures.items += len(outcome.timeline.items)
        for item in outcome.timeline.items:
            finals = [s for s in item.steps if s.state in FINAL_STATES]
            state = finals[-1].state if finals else (PENDING if outcome.waiting_state(item) else "OPEN")
            figures.final_states[state] += 1
            if len(finals) > 1:
                problems.append(f"{spec.label}: item {item.item_id} has {len(finals)} final states "
                                f"{[s.state for s in finals]}")
            if state == "OPEN":
                problems.append(f"{spec.label}: item {item.item_id} never settled")
            allowed = wanted.get(item.item_id or "", set()) | {QUARANTINED}
            if state not in allowed:
                problems.append(f"{spec.label}: item {item.item_id} ended {state}, fixture allows {sorted(allowed)}")
            if item.call_id:
                item_of_call[item.call_id] = (spec.label, item.item_id or "")
                final_of_call[item.call_id] = state
        # the last attempts are what the fixture describes, exactly (extra ones come from re-streaming)
        n_fixture_attempts = max(_EXPECT_ATTEMPTS[spec.label] or [1])
        tail = order[-n_fixture_attempts:] if expected else []
        figures.extra_attempt_items += sum(len(attempts[a]) for a in order[: len(order) - len(tail)])
        for attempt_number, attempt_id in enumerate(tail, start=n_fixture_attempts - len(tail) + 1):
            want = [(k, e) for (k, e), n in zip(expected, _EXPECT_ATTEMPTS[spec.label], strict=True)
                    if n == attempt_number]
            got = {i.item_id: i for i in attempts[attempt_id]}
            for item_id, exp in want:
                item = got.get(item_id)
                if item is None:
                    problems.append(f"{spec.label}: expected item {item_id} of attempt {attempt_number} is missing")
                    continue
                state, reason = outcome.final_of(item)
                if state not in _allowed_finals(exp):
                    problems.append(f"{spec.label}: item {item_id} ended {state}, expected {exp.state}")
                elif exp.state == ItemState.REJECTED.value and exp.reason and reason != exp.reason:
                    problems.append(f"{spec.label}: item {item_id} rejected for {reason}, expected {exp.reason}")
        if len(tail) < n_fixture_attempts and expected:
            problems.append(f"{spec.label}: {len(tail)} attempts with items, the fixture has {n_fixture_attempts}")

    # every terminal item reached the validator's decision
    for item in terminal:
        if item.call_id not in final_of_call:
            problems.append(f"terminal item {item.call_id} of run {item.run_id} has no decision in the audit trail")

    # nothing invalid approved; one approval per call; signatures verify
    figures.approved = len(approved)
    approvals = Counter(c.call_id for c in approved)
    problems += [f"call {cid} approved {n} times" for cid, n in approvals.items() if n > 1]
    for call in approved:
        try:
            verify(call, keys)
        except Exception as exc:  # noqa: BLE001 - any failure to verify is the finding
            problems.append(f"approved call {call.call_id} does not verify: {type(exc).__name__}")
        where = item_of_call.get(call.call_id)
        if where is None:
            problems.append(f"approved call {call.call_id} belongs to no item of a submitted run")
            continue
        label, item_id = where
        states = {e.state for k, e in _EXPECT_ITEMS[label] if k == item_id}
        if not states & {ItemState.POLICY_APPROVED.value, ItemState.EXECUTED.value}:
            problems.append(f"{label}: item {item_id} was approved, its fixture expects {sorted(states)}")

    # one result per approved call; the ledger settled the same way
    figures.results = len(results)
    by_result = Counter(r.call_id for r in results)
    problems += [f"call {cid} has {n} results" for cid, n in by_result.items() if n > 1]
    missing = set(approvals) - set(by_result)
    problems += [f"approved call {cid} has no result" for cid in sorted(missing)]
    problems += [f"result for call {cid} that was never approved" for cid in set(by_result) - set(approvals)]
    last_entry: dict[str, LedgerEntry] = {}
    started = Counter()
    for entry in ledger_entries:
        if entry.phase == "STARTED":
            started[entry.call_id] += 1
        if entry.call_id not in last_entry or last_entry[entry.call_id].phase == "STARTED":
            last_entry[entry.call_id] = entry
    result_state = {r.call_id: r.state for r in results}
    for call_id, state in result_state.items():
        entry = last_entry.get(call_id)
        if entry is None or entry.phase == "STARTED" or entry.state != state:
            problems.append(f"call {call_id}: ledger {entry.phase if entry else None}/{entry.state if entry else None}"
                            f" vs result {state}")
    problems += [f"call {cid} STARTED {n} times in the ledger" for cid, n in started.items() if n > 1]

    # side effects on disk: never more renames onto a target than calls approved to write it
    renames.drain()
    if renames.overflowed:
        problems.append("inotify queue overflowed: the disk count is incomplete")
    decision = {r.call_id: r.extra.get("decision") for r in audit if r.stage == "executor" and r.call_id}
    calls_for: dict[str, list[ApprovedCall]] = defaultdict(list)
    for call in approved:
        if call.tool_name == "write_file":
            path = _write_target(call)
            if path and path.startswith(f"{CHAOS_DIR}/"):
                calls_for[path.removeprefix(f"{CHAOS_DIR}/")].append(call)
    for label, target in workload.unique_targets.items():
        name = target.removeprefix(f"{CHAOS_DIR}/")
        calls = calls_for.get(name, [])
        done = renames.counts[name]
        ran = sum(result_state.get(c.call_id) == "EXECUTED" and decision.get(c.call_id) == "run" for c in calls)
        executed = sum(result_state.get(c.call_id) == "EXECUTED" for c in calls)
        figures.unique_writes_executed += done
        if done > len(calls):
            problems.append(f"{label}: {done} writes on disk for {len(calls)} approved calls (ran twice)")
        if not ran <= done <= max(executed, ran):
            problems.append(f"{label}: {done} writes on disk, {ran} run and {executed} executed by the results")
        if calls and not done and executed:
            problems.append(f"{label}: EXECUTED in the results but never written")
    return figures


def _write_target(call: ApprovedCall) -> str | None:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return None
    return args.get("path") if isinstance(args, dict) else None


# ------------------------------------------------------------------ the test


async def _chaos(tmp_path: Path, plan: ChaosPlan) -> None:
    rng = random.Random(plan.seed)
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_ROOT, fixtures)
    workload = build_workload(rng, fixtures, plan.runs)
    _attach_item_ids(workload.specs, fixtures)
    broker = LocalBroker(state_dir=tmp_path / "broker", port=free_port())
    await asyncio.to_thread(broker.start)
    started = time.monotonic()
    renames: RenameWatch | None = None
    try:
        pipeline = Pipeline(bootstrap=broker.address, work_dir=tmp_path / "work", fixtures_root=fixtures)
        async with pipeline:
            chaos_dir = tmp_path / "work" / "workspaces" / "demo" / CHAOS_DIR
            chaos_dir.mkdir(parents=True, exist_ok=True)
            renames = RenameWatch(chaos_dir)
            chaos = Chaos(pipeline, broker, plan, rng)
            submitter = asyncio.create_task(_submit_all(pipeline, chaos, workload.specs, rng, plan.submit_gap_s))
            agent = asyncio.create_task(chaos.run())
            try:
                while not (submitter.done() and agent.done()):
                    chaos.restart_crashed()
                    await asyncio.wait({submitter, agent}, timeout=0.2)
                await submitter
                await agent
                outcomes = await _settle(pipeline, chaos, plan.settle_timeout_s)
            finally:
                submitter.cancel()
                agent.cancel()
            figures = await conservation(pipeline, outcomes, workload, renames)
    finally:
        if renames is not None:
            renames.close()
        await asyncio.to_thread(broker.stop)
    elapsed = time.monotonic() - started
    log = chaos.log
    print(
        f"\nchaos: {figures.runs} runs, {figures.items} items ({figures.extra_attempt_items} from re-streamed "
        f"attempts) in {elapsed:.0f}s\n"
        f"  kills per stage: {dict(sorted(log.kills.items()))} (total {sum(log.kills.values())}), "
        f"restarts after kills: {log.restarts}, crash restarts: {len(log.crash_restarts)} "
        f"{[name for name, _ in log.crash_restarts]}\n"
        f"  partition moves: {len(log.partition_moves)} {log.partition_moves}, broker restarts: "
        f"{log.broker_restarts}\n"
        f"  final states: {dict(sorted(figures.final_states.items()))}\n"
        f"  approved calls: {figures.approved}, results: {figures.results}, unique-target writes on disk: "
        f"{figures.unique_writes_executed}"
    )
    assert not figures.problems, "\n".join(figures.problems[:40])
    assert figures.runs == plan.runs
    assert sum(log.kills.values()) == plan.kills and set(log.kills) == set(STAGES)
    assert len(log.partition_moves) == plan.partition_moves
    assert log.broker_restarts == plan.broker_restarts
    # a worker may give up while the broker is away (its supervisor restarts it); at no other time
    if log.broker_down is not None:
        down_from, down_to = log.broker_down
        unexplained = [n for n, at in log.crash_restarts if not down_from <= at <= down_to + 60]
        assert not unexplained, f"workers crashed outside the broker restart: {unexplained}"
    assert figures.final_states[ItemState.EXECUTED.value] > 0 and figures.final_states[QUARANTINED] > 0
    assert figures.final_states[ItemState.REJECTED.value] > 0


def _plan_from_env() -> ChaosPlan:
    return LONG if os.environ.get("CALLGATE_CHAOS", "bounded") == "long" else BOUNDED


@pytest.mark.timeout(600)
async def test_chaos_conservation(tmp_path: Path) -> None:
    await _chaos(tmp_path, _plan_from_env())


@pytest.mark.slow
@pytest.mark.timeout(2400)
async def test_chaos_conservation_long(tmp_path: Path) -> None:
    await _chaos(tmp_path, LONG)
