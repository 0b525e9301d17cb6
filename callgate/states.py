"""The item state machine of DESIGN.md, shared by every stage."""

from __future__ import annotations

from enum import StrEnum


class ItemState(StrEnum):
    RECEIVING = "RECEIVING"
    ITEM_OPEN = "ITEM_OPEN"
    ITEM_TERMINAL = "ITEM_TERMINAL"
    PARSED = "PARSED"
    SCHEMA_VALID = "SCHEMA_VALID"
    PENDING_APPROVAL = "PENDING_APPROVAL"
    POLICY_APPROVED = "POLICY_APPROVED"
    # final states: every item ends in exactly one of these
    QUARANTINED = "QUARANTINED"
    REJECTED = "REJECTED"
    EXECUTED = "EXECUTED"
    FAILED = "FAILED"
    IN_DOUBT = "IN_DOUBT"


FINAL_STATES = frozenset(
    {ItemState.QUARANTINED, ItemState.REJECTED, ItemState.EXECUTED, ItemState.FAILED, ItemState.IN_DOUBT}
)

# Allowed forward moves; anything before ITEM_TERMINAL may also go to QUARANTINED.
TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    ItemState.RECEIVING: frozenset({ItemState.ITEM_OPEN, ItemState.QUARANTINED}),
    ItemState.ITEM_OPEN: frozenset({ItemState.ITEM_TERMINAL, ItemState.QUARANTINED}),
    ItemState.ITEM_TERMINAL: frozenset({ItemState.PARSED, ItemState.REJECTED}),
    ItemState.PARSED: frozenset({ItemState.SCHEMA_VALID, ItemState.REJECTED}),
    ItemState.SCHEMA_VALID: frozenset(
        {ItemState.POLICY_APPROVED, ItemState.PENDING_APPROVAL, ItemState.REJECTED}
    ),
    ItemState.PENDING_APPROVAL: frozenset({ItemState.POLICY_APPROVED, ItemState.REJECTED}),
    ItemState.POLICY_APPROVED: frozenset({ItemState.EXECUTED, ItemState.FAILED, ItemState.IN_DOUBT}),
}


def can_move(current: ItemState, target: ItemState) -> bool:
    return target in TRANSITIONS.get(current, frozenset())
