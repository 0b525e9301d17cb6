"""Start, stop and kill worker processes: used by the demo, the chaos suite and benchmarks.

Each worker is a real `python -m callgate STAGE` process with its own
environment; its output goes to a log file (structlog JSON lines, sanitized by
construction) so a failing run can be diagnosed afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class WorkerProcess:
    stage: str  # a callgate subcommand: ingest | normalizer | validator | executor | upstream ...
    env: Mapping[str, str]
    log_dir: Path
    args: Sequence[str] = ()
    name: str = ""
    interpreter_args: Sequence[str] = ()  # before `-m callgate`, e.g. ("-m", "cProfile", "-o", PATH) for a profile
    process: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    exit_expected: bool = False  # set by kill() and stop(): such an exit is ours, not a crash
    _log_paths: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.name or self.stage

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self.starts += 1
        self.exit_expected = False
        log_path = self.log_dir / f"{self.name}.{self.starts}.log"
        self._log_paths.append(log_path)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, *self.interpreter_args, "-m", "callgate", self.stage, *self.args],
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flush; what a crash looks like."""
        if self.running:
            assert self.process is not None
            self.exit_expected = True
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.kills += 1

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not stop in time. Returns the exit code."""
        if self.process is None:
            return None
        self.exit_expected = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self._log_paths if p.exists())


@dataclass(slots=True)
class Fleet:
    """A set of worker processes started and stopped together."""

    workers: list[WorkerProcess] = field(default_factory=list)

    def add(self, worker: WorkerProcess) -> WorkerProcess:
        self.workers.append(worker)
        return worker

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def stop(self) -> None:
        for worker in reversed(self.workers):
            worker.stop()

    def dead(self) -> list[WorkerProcess]:
        """Workers that exited on their own (not killed by us and not stopped)."""
        return [
            w for w in self.workers
            if w.process is not None and w.process.poll() is not None and not w.exit_expected
        ]


def wait_for(condition, *, timeout_s: float, interval_s: float = 0.1, what: str = "condition") -> None:
    """Poll a condition until it holds; TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f}s")
        time.sleep(interval_s)
