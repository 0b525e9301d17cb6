"""The whole pipeline on one machine: what the demo, the end-to-end tests and the chaos suite run.

A `Pipeline` provisions a topic namespace, writes a policy directory whose
workspaces live under its own work directory, serves the shipped fixtures
from a real local HTTP upstream, starts the four workers as real processes,
submits runs to `callgate.runs`, and follows the sanitized audit topic until
every item of every run has settled. Nothing here reads a restricted topic:
the outcome of a run is reconstructed from audit records alone, exactly as an
operator would with `callgate trace`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

from callgate import avro
from callgate.errors import RecordError
from callgate.kafka import create_topics, iter_topic, make_producer
from callgate.records import AuditRecord, RunRequest
from callgate.settings import REPO_ROOT
from callgate.states import FINAL_STATES, ItemState
from callgate.supervise import Fleet, WorkerProcess
from callgate.topics import TopicNames
from callgate.trace import RunTimeline, build_timeline

STAGES = ("ingest", "normalizer", "validator", "executor")
FIXTURES_ROOT = REPO_ROOT / "fixtures"
POLICIES_ROOT = REPO_ROOT / "policies"
WORKSPACE_SAMPLE = FIXTURES_ROOT / "workspace"
# An item is settled when it reached a final state, or waits for a person.
SETTLED_STATES = FINAL_STATES | {ItemState.PENDING_APPROVAL}


@dataclass(frozen=True, slots=True)
class ExpectedItem:
    state: str
    reason: str | None
    item_id: str | None = None  # the provider's item id (or index) the fixture uses


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run to submit: a fixture served by the upstream, and what the gate must decide."""

    label: str  # route/case, for people
    route: str
    attempts: tuple[str, ...]  # fixture paths relative to the fixtures root, one per upstream request
    tool_set: tuple[str, ...]
    policy_id: str
    expected: tuple[ExpectedItem, ...] | None = None
    upstream_options: tuple[tuple[str, str], ...] = ()


def load_fixture_specs(root: Path = FIXTURES_ROOT) -> list[RunSpec]:
    """Every shipped fixture with an expectations file, as a run to submit.

    `<route>/<case>.expect.json` names the tool set, the policy, the attempt
    files (default `<case>.sse`) and the expected final state of each item.
    """
    specs: list[RunSpec] = []
    for expect_path in sorted(root.glob("*/*.expect.json")):
        route = expect_path.parent.name
        case = expect_path.name.removesuffix(".expect.json")
        expect = json.loads(expect_path.read_text(encoding="utf-8"))
        attempts = expect.get("attempts") or [f"{case}.sse"]
        items = tuple(
            ExpectedItem(item["state"], item.get("reason"), item.get("item_id"))
            for item in expect.get("items", [])
        )
        specs.append(
            RunSpec(
                label=f"{route}/{case}",
                route=expect.get("route", route),
                attempts=tuple(f"{route}/{a}" for a in attempts),
                tool_set=tuple(expect.get("tool_set") or expect.get("tools") or ()),
                policy_id=expect.get("policy_id") or expect.get("policy") or "demo",
                expected=items,
                upstream_options=tuple(sorted((expect.get("upstream") or {}).items())),
            )
        )
    return specs


def _seed_workspace(workspace: Path, sample: Path = WORKSPACE_SAMPLE) -> None:
    """A small git repository, so the fixtures' reads, writes and git commands have something to touch."""
    shutil.copytree(sample, workspace)
    git = ["git", "-C", str(workspace), "-c", "user.name=callgate demo", "-c", "user.email=demo@localhost"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "sample project"], check=True)


def write_policies(target: Path, workspace_base: Path, source: Path = POLICIES_ROOT) -> dict[str, Path]:
    """Copy the policy files with each workspace root moved under workspace_base (made, git-inited)."""
    target.mkdir(parents=True, exist_ok=True)
    workspaces: dict[str, Path] = {}
    for path in sorted(source.glob("*.toml")):
        workspace = workspace_base / path.stem
        text = re.sub(
            r'(?m)^(\s*workspace_root\s*=\s*)"[^"]*"', lambda m: f'{m.group(1)}"{workspace}"', path.read_text()
        )
        (target / path.name).write_text(text)
        if not workspace.exists():
            _seed_workspace(workspace)
        workspaces[path.stem] = workspace
    return workspaces


@dataclass(slots=True)
class Outcome:
    spec: RunSpec
    run_id: str
    timeline: RunTimeline

    @property
    def settled(self) -> bool:
        if self.spec.expected is None:
            return False
        items = self.timeline.items
        return len(items) >= len(self.spec.expected) and all(
            (i.final_state or self.waiting_state(i)) is not None for i in items
        )

    @staticmethod
    def waiting_state(item) -> str | None:
        states = [s.state for s in item.steps]
        return ItemState.PENDING_APPROVAL.value if ItemState.PENDING_APPROVAL.value in states else None

    def final_of(self, item) -> tuple[str, str | None]:
        if item.final_state is not None:
            return item.final_state, item.final_reason
        if self.waiting_state(item):
            return ItemState.PENDING_APPROVAL.value, None
        return "OPEN", None


@dataclass(slots=True)
class AuditFollower:
    """Follows the audit topic in the background, keeping every record by run."""

    bootstrap: str
    topic: str
    by_run: dict[str, list[AuditRecord]] = field(default_factory=dict)
    undecodable: int = 0
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for message in iter_topic(self.bootstrap, self.topic):
            try:
                record = avro.decode(message.value, topic=message.topic, partition=message.partition,
                                     offset=message.offset)
            except RecordError:
                self.undecodable += 1
                continue
            if isinstance(record, AuditRecord):
                self.by_run.setdefault(record.run_id, []).append(record)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


@dataclass(slots=True)
class Pipeline:
    bootstrap: str
    work_dir: Path
    namespace: str = field(default_factory=lambda: f"demo{uuid.uuid4().hex[:8]}")
    partitions: int = 3
    fixtures_root: Path = FIXTURES_ROOT
    workers_per_stage: dict[str, int] = field(default_factory=lambda: {s: 1 for s in STAGES})
    extra_env: dict[str, str] = field(default_factory=dict)
    fleet: Fleet = field(default_factory=Fleet)
    runs: dict[str, RunSpec] = field(default_factory=dict)
    _upstream: object | None = None
    _audit: AuditFollower | None = None
    _producer: object | None = None
    _exit: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _signing_key: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.namespace)

    def env(self) -> dict[str, str]:
        return {
            "CALLGATE_KAFKA_BOOTSTRAP": self.bootstrap,
            "CALLGATE_TOPIC_NAMESPACE": self.namespace,
            "CALLGATE_PARTITIONS": str(self.partitions),
            "CALLGATE_SIGNING_KEYS": f"demo:{self._signing_key}",
            "CALLGATE_SIGNING_KEY_ID": "demo",
            "CALLGATE_POLICIES_DIR": str(self.work_dir / "policies"),
            **self.extra_env,
        }

    def add_worker(self, stage: str, index: int) -> WorkerProcess:
        args: tuple[str, ...] = ()
        if stage == "executor":
            # static membership: a restarted executor takes its partitions back at once
            args = ("--instance-id", f"{self.namespace}-executor-{index}", "--session-timeout-ms", "6000")
        return self.fleet.add(
            WorkerProcess(stage, self.env(), self.work_dir / "logs", args=args, name=f"{stage}-{index}")
        )

    async def __aenter__(self) -> Pipeline:
        from ingest.upstream import LocalUpstream

        self.work_dir.mkdir(parents=True, exist_ok=True)
        await create_topics(self.bootstrap, self.topics, self.partitions)
        write_policies(self.work_dir / "policies", self.work_dir / "workspaces")
        self._upstream = await self._exit.enter_async_context(LocalUpstream(self.fixtures_root))
        self._audit = AuditFollower(self.bootstrap, self.topics.audit)
        await self._audit.start()
        self._producer = await make_producer(self.bootstrap)
        for stage in STAGES:
            for index in range(self.workers_per_stage.get(stage, 1)):
                self.add_worker(stage, index)
        self.fleet.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.fleet.stop)
        if self._producer is not None:
            await self._producer.stop()
        if self._audit is not None:
            await self._audit.stop()
        await self._exit.aclose()

    def url_for(self, spec: RunSpec, run_id: str) -> str:
        base = self._upstream.base_url.rstrip("/")  # type: ignore[union-attr]
        params = dict(spec.upstream_options)
        params["key"] = run_id
        if len(spec.attempts) > 1:
            params["attempts"] = ",".join(spec.attempts)
        return f"{base}/{quote(spec.attempts[0])}?{urlencode(params)}"

    async def submit(self, spec: RunSpec, run_id: str | None = None) -> str:
        run_id = run_id or f"run-{uuid.uuid4().hex[:16]}"
        request = RunRequest(
            run_id=run_id, route=spec.route, model="fixture", upstream_url=self.url_for(spec, run_id),
            request_body=b'{"stream": true}', tool_set=list(spec.tool_set), policy_id=spec.policy_id,
            submitted_at=int(time.time() * 1000),
        )
        await self._producer.send_and_wait(  # type: ignore[union-attr]
            self.topics.runs, avro.encode(request), key=run_id.encode()
        )
        self.runs[run_id] = spec
        return run_id

    def outcomes(self) -> list[Outcome]:
        assert self._audit is not None
        return [
            Outcome(spec, run_id, build_timeline(run_id, list(self._audit.by_run.get(run_id, ()))))
            for run_id, spec in self.runs.items()
        ]

    def audit_records(self) -> list[AuditRecord]:
        assert self._audit is not None
        return [r for records in self._audit.by_run.values() for r in records]

    async def settle(
        self,
        *,
        timeout_s: float,
        on_progress: Callable[[int, int], None] | None = None,
        run_ids: Iterable[str] | None = None,
    ) -> list[Outcome]:
        """Wait until every submitted run has settled; TimeoutError (with the stragglers) at the deadline."""
        wanted = set(run_ids) if run_ids is not None else set(self.runs)
        deadline = time.monotonic() + timeout_s
        while True:
            outcomes = [o for o in self.outcomes() if o.run_id in wanted]
            done = sum(o.settled for o in outcomes)
            if on_progress is not None:
                on_progress(done, len(outcomes))
            if done == len(outcomes):
                return outcomes
            dead = [w.name for w in self.fleet.dead()]
            if dead:
                raise RuntimeError(f"workers exited: {', '.join(dead)}; logs in {self.work_dir / 'logs'}")
            if time.monotonic() > deadline:
                stragglers = [o.spec.label for o in outcomes if not o.settled]
                raise TimeoutError(f"{len(stragglers)} runs not settled: {', '.join(stragglers[:10])}")
            await asyncio.sleep(0.2)  # polling the follower's state with a deadline

