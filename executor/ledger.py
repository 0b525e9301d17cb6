"""The decision ledger: the pure core that makes "each call runs at most once" hold.

Per call id the ledger moves STARTED -> FINISHED (state EXECUTED or FAILED),
or STARTED -> IN_DOUBT when a crash left the outcome unknown and reconcile
could not settle it. FINISHED and IN_DOUBT are final; nothing moves a call
back. The durable copy is a compacted Kafka topic (see README "Executor");
this module only folds entries into a view and decides, with no I/O.

    decide(call_id, view) -> Run        no entry: write STARTED (acked) then run
                           -> Skip      final entry: already settled, run nothing
                           -> Reconcile STARTED only: it may have run; never re-run blindly
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from callgate.records import LedgerEntry
from callgate.signing import keyed_digest
from callgate.states import ItemState


class Phase(StrEnum):
    STARTED = "STARTED"
    FINISHED = "FINISHED"
    IN_DOUBT = "IN_DOUBT"


FINAL_PHASES = frozenset({Phase.FINISHED, Phase.IN_DOUBT})


@dataclass(frozen=True, slots=True)
class Run:
    pass


@dataclass(frozen=True, slots=True)
class Skip:
    entry: LedgerEntry


@dataclass(frozen=True, slots=True)
class Reconcile:
    entry: LedgerEntry


Decision = Run | Skip | Reconcile


@dataclass(slots=True)
class LedgerView:
    """The latest entry per call id, as restored from the ledger partition plus own writes."""

    entries: dict[str, LedgerEntry] = field(default_factory=dict)

    def apply(self, entry: LedgerEntry) -> None:
        """Fold one entry in; a final entry is never overwritten by a later STARTED."""
        current = self.entries.get(entry.call_id)
        if current is not None and Phase(current.phase) in FINAL_PHASES:
            return  # final is final: the first settlement stands
        self.entries[entry.call_id] = entry

    def get(self, call_id: str) -> LedgerEntry | None:
        return self.entries.get(call_id)

    def __len__(self) -> int:
        return len(self.entries)


def decide(call_id: str, view: LedgerView) -> Decision:
    entry = view.get(call_id)
    if entry is None:
        return Run()
    if Phase(entry.phase) in FINAL_PHASES:
        return Skip(entry)
    return Reconcile(entry)


def intent_digest(tool_name: str, args: dict[str, Any], key: bytes) -> str | None:
    """A keyed HMAC of the effect a call intends, so the ledger never holds content.

    Only write_file has an effect reconcile can observe afterwards.
    """
    if tool_name == "write_file" and isinstance(args.get("content"), str):
        return content_digest(args["content"].encode("utf-8"), key)
    return None


def content_digest(content: bytes, key: bytes) -> str:
    return keyed_digest(key, b"callgate.executor.write_file\x00" + content)


def started(
    *, call_id: str, run_id: str, tool_name: str, now_ms: int, executor_id: str, digest: str | None
) -> LedgerEntry:
    return LedgerEntry(
        call_id=call_id,
        run_id=run_id,
        tool_name=tool_name,
        phase=Phase.STARTED.value,
        state=None,
        updated_at=now_ms,
        intent_digest=digest,
        executor_id=executor_id,
    )


def settled(entry: LedgerEntry, state: ItemState, *, now_ms: int, executor_id: str) -> LedgerEntry:
    """The final entry that follows a STARTED one: FINISHED, or IN_DOUBT."""
    if state is ItemState.IN_DOUBT:
        phase = Phase.IN_DOUBT
    elif state in (ItemState.EXECUTED, ItemState.FAILED):
        phase = Phase.FINISHED
    else:
        raise ValueError(f"not a final execution state: {state.value}")
    return LedgerEntry(
        call_id=entry.call_id,
        run_id=entry.run_id,
        tool_name=entry.tool_name,
        phase=phase.value,
        state=state.value,
        updated_at=now_ms,
        intent_digest=entry.intent_digest,
        executor_id=executor_id,
    )
