"""Topic names and their provisioning defaults.

Names live under a namespace (default "callgate"), so tests and demos can run
isolated topic sets side by side on one broker: `TopicNames("t-1a2b")`.
"""

from __future__ import annotations

from dataclasses import dataclass

DAY_MS = 24 * 60 * 60 * 1000
DEFAULT_NAMESPACE = "callgate"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    retention_ms: int
    compacted: bool = False
    # restricted topics carry raw tool arguments; audit and logs never do
    restricted: bool = False


@dataclass(frozen=True, slots=True)
class TopicNames:
    namespace: str = DEFAULT_NAMESPACE

    @property
    def runs(self) -> str:
        return f"{self.namespace}.runs"

    @property
    def sse_raw(self) -> str:
        return f"{self.namespace}.sse.raw"

    @property
    def items(self) -> str:
        return f"{self.namespace}.items"

    @property
    def calls_approved(self) -> str:
        return f"{self.namespace}.calls.approved"

    @property
    def calls_pending(self) -> str:
        return f"{self.namespace}.calls.pending"

    @property
    def approvals(self) -> str:
        return f"{self.namespace}.approvals"

    @property
    def results(self) -> str:
        return f"{self.namespace}.results"

    @property
    def dlq(self) -> str:
        return f"{self.namespace}.dlq"

    @property
    def quarantine(self) -> str:
        """Raw buffers of quarantined items, only when data handling is `keep`."""
        return f"{self.namespace}.quarantine"

    @property
    def audit(self) -> str:
        return f"{self.namespace}.audit"

    @property
    def ledger(self) -> str:
        """Executor decision ledger: compacted, keyed by call id."""
        return f"{self.namespace}.executor.ledger"

    def specs(self) -> tuple[TopicSpec, ...]:
        return (
            TopicSpec(self.runs, 7 * DAY_MS, restricted=True),
            TopicSpec(self.sse_raw, 3 * DAY_MS, restricted=True),
            TopicSpec(self.items, 3 * DAY_MS, restricted=True),
            TopicSpec(self.calls_approved, 7 * DAY_MS, restricted=True),
            TopicSpec(self.calls_pending, 7 * DAY_MS, restricted=True),
            TopicSpec(self.approvals, 7 * DAY_MS),
            TopicSpec(self.results, 7 * DAY_MS, restricted=True),
            TopicSpec(self.dlq, 30 * DAY_MS),
            TopicSpec(self.quarantine, 3 * DAY_MS, restricted=True),
            TopicSpec(self.audit, 90 * DAY_MS),
            TopicSpec(self.ledger, -1, compacted=True, restricted=True),
        )


DEFAULT_TOPICS = TopicNames()
