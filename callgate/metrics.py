"""Prometheus metrics shared by every worker.

Labels are low-cardinality by construction: stage, route, final state and
reason class (closed enums). Provider event types, tool names and ids never
become labels: an attacker-chosen event name would otherwise blow up the
series count and leak content into monitoring. The helpers enforce this: a
state or reason outside ItemState / Reason becomes "other", a route that is
not a short slug (or one past the first MAX_ROUTES seen) becomes "other".

What a stage calls
------------------

    port = start_metrics(settings, "normalizer")   # once, at startup; None when metrics_port is unset
    ...
    record_event("normalizer")                     # per input record (count=n for a batch)
    record_decision("normalizer", state, reason)   # per item reaching a state (ItemState / Reason values)
    observe_decision_latency("validator", item.terminal_at, now_ms)   # terminal event -> decision
    record_unknown_event(route)                    # per provider event no adapter knew (count=n)
    ...
    stop_metrics(port)                             # on shutdown (tests run many workers in one process)

`start_metrics` serves /metrics on 127.0.0.1:settings.metrics_port (0 picks a
free port) and logs "metrics endpoint listening" with `stage` and `port`, so
a supervisor finds the endpoint in the JSON log. `serving_ports(stage)` gives
the bound ports to code in the same process.

Consumer lag, CONSUMER_LAG{stage,topic,partition}, is published by
callgate.kafka.TransactionalStage for every transactional stage (pass
`metrics_stage=`; by default it is inferred from a group id ending in a
stage name), and by any other consumer loop through `LagTracker`.

Replays: a stage that rebuilds state by replaying committed input must not
count the replayed records again (they were counted when first processed):
record only on the live path. An aborted transaction is retried, so counters
are at-least-once across such aborts; the Kafka outputs stay exactly-once.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from callgate.errors import Reason
from callgate.logging import get_logger
from callgate.states import ItemState

log = get_logger("callgate.metrics")

STAGES = frozenset({"ingest", "normalizer", "validator", "executor"})
MAX_ROUTES = 32  # routes are deployment config; more than this means labels are being fed content

REGISTRY = CollectorRegistry(auto_describe=True)

EVENTS_IN = Counter(
    "callgate_events_in_total",
    "Records consumed by a stage.",
    ("stage",),
    registry=REGISTRY,
)
ITEMS_FINAL = Counter(
    "callgate_items_total",
    "Items decided by a stage, by the state they reached and the reason class.",
    ("stage", "state", "reason"),
    registry=REGISTRY,
)
UNKNOWN_EVENTS = Counter(
    "callgate_unknown_events_total",
    "Provider events no adapter version recognised (kept for diagnostics, never acted on).",
    ("route",),
    registry=REGISTRY,
)
DECISION_LATENCY = Histogram(
    "callgate_decision_latency_seconds",
    "Time from an item's terminal event to the stage's decision being produced.",
    ("stage",),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
CONSUMER_LAG = Gauge(
    "callgate_consumer_lag_records",
    "Records between the stage's position and the partition's last stable offset.",
    ("stage", "topic", "partition"),
    registry=REGISTRY,
)

_STATES = frozenset(s.value for s in ItemState)
_REASONS = frozenset(r.value for r in Reason)
_ROUTE_SHAPE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,47}")
_routes_seen: set[str] = set()
_routes_lock = threading.Lock()


# ---------------------------------------------------------------- labels


def _stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown stage label {stage!r}; one of {sorted(STAGES)}")
    return stage


def state_label(state: ItemState | str) -> str:
    value = str(state.value if isinstance(state, ItemState) else state)
    return value if value in _STATES else "other"


def reason_label(reason: Reason | str | None) -> str:
    if reason is None or reason == "":
        return "none"
    value = str(reason.value if isinstance(reason, Reason) else reason)
    return value if value in _REASONS else "other"


def route_label(route: str | None) -> str:
    if not route or not _ROUTE_SHAPE.fullmatch(route):
        return "other"
    with _routes_lock:
        if route in _routes_seen:
            return route
        if len(_routes_seen) >= MAX_ROUTES:
            return "other"
        _routes_seen.add(route)
        return route


# ---------------------------------------------------------------- recording


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def record_event(stage: str, count: int = 1) -> None:
    """Input records a stage consumed (live path only, not replays)."""
    if count > 0:
        EVENTS_IN.labels(stage=_stage(stage)).inc(count)


def record_decision(stage: str, state: ItemState | str, reason: Reason | str | None) -> None:
    """One item reached `state` at this stage; reason is a Reason (value) or None."""
    ITEMS_FINAL.labels(stage=_stage(stage), state=state_label(state), reason=reason_label(reason)).inc()


def observe_decision_latency(stage: str, terminal_at_ms: int, now_ms: int | None = None) -> float:
    """Seconds from the item's terminal event (or approval, for the executor) to this decision.

    A clock behind the producer's would give a negative time: clamped to 0.
    Returns the observed seconds.
    """
    now = wall_clock_ms() if now_ms is None else now_ms
    seconds = max(0.0, (now - terminal_at_ms) / 1000)
    DECISION_LATENCY.labels(stage=_stage(stage)).observe(seconds)
    return seconds


def record_unknown_event(route: str | None, count: int = 1) -> None:
    """Provider events no adapter version recognised, by route."""
    if count > 0:
        UNKNOWN_EVENTS.labels(route=route_label(route)).inc(count)


# ---------------------------------------------------------------- consumer lag


class _LagConsumer(Protocol):
    def assignment(self) -> set[Any]: ...

    def highwater(self, partition: Any) -> int | None: ...

    def last_stable_offset(self, partition: Any) -> int | None: ...

    async def position(self, partition: Any) -> int: ...


class LagTracker:
    """Publishes CONSUMER_LAG for one stage's consumer and forgets partitions it no longer owns.

    Lag is the last stable offset (read_committed; the high watermark when the
    broker gives none) minus the consumer's position. The position, not the
    committed offset, because transaction markers take offsets too: a stage
    caught up behind a transactional producer would otherwise never show 0.
    Both ends come from the last fetch response, so a partition never fetched
    yet has no series.
    """

    POSITION_WAIT_S = 0.05  # a partition being reset has no position yet: skip it this time

    def __init__(self, stage: str) -> None:
        self.stage = _stage(stage)
        self._series: set[tuple[str, str]] = set()

    async def update(self, consumer: _LagConsumer, partitions: Iterable[Any]) -> dict[tuple[str, int], int]:
        """Set the lag of each owned TopicPartition in `partitions`; returns {(topic, partition): lag}."""
        assigned = consumer.assignment()
        owned = [tp for tp in partitions if tp in assigned]
        published: dict[tuple[str, int], int] = {}
        for tp in owned:
            end = consumer.last_stable_offset(tp)
            if end is None or end < 0:
                end = consumer.highwater(tp)
            if end is None:
                continue
            try:
                position = await asyncio.wait_for(consumer.position(tp), self.POSITION_WAIT_S)
            except Exception:  # noqa: BLE001 - unassigned mid-rebalance, or resetting (TimeoutError)
                continue
            lag = max(0, end - position)
            CONSUMER_LAG.labels(stage=self.stage, topic=tp.topic, partition=str(tp.partition)).set(lag)
            published[(tp.topic, tp.partition)] = lag
        current = {(tp.topic, str(tp.partition)) for tp in owned}
        for topic, partition in self._series - current:
            _remove_lag(self.stage, topic, partition)
        self._series = (self._series & current) | {(t, str(p)) for t, p in published}
        return published

    def clear(self) -> None:
        for topic, partition in self._series:
            _remove_lag(self.stage, topic, partition)
        self._series = set()


def _remove_lag(stage: str, topic: str, partition: str) -> None:
    try:
        CONSUMER_LAG.remove(stage, topic, partition)
    except KeyError:
        pass


def stage_of(group_id: str) -> str | None:
    """The stage a consumer group id names by its last component ("ns-validator" -> "validator")."""
    last = re.split(r"[-.]", group_id)[-1]
    return last if last in STAGES else None


# ---------------------------------------------------------------- endpoint


class _HasMetricsPort(Protocol):
    @property
    def metrics_port(self) -> int | None: ...


_servers: dict[int, tuple[Any, threading.Thread, str | None]] = {}
_servers_lock = threading.Lock()


def serve(port: int, addr: str = "127.0.0.1", stage: str | None = None) -> int:
    """Expose /metrics on a background thread; returns the bound port (0 picks a free one)."""
    server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
    bound = int(server.server_address[1])
    with _servers_lock:
        _servers[bound] = (server, thread, stage)
    log.info("metrics endpoint listening", stage=stage, address=addr, port=bound)
    return bound


def start_metrics(settings: _HasMetricsPort, stage: str) -> int | None:
    """Serve /metrics on 127.0.0.1:settings.metrics_port when it is set; returns the bound port."""
    if settings.metrics_port is None:
        return None
    return serve(settings.metrics_port, stage=_stage(stage))


def stop_metrics(port: int | None) -> None:
    """Shut an endpoint started here down (no-op for None or an unknown port)."""
    if port is None:
        return
    with _servers_lock:
        entry = _servers.pop(port, None)
    if entry is None:
        return
    server, thread, _stage_name = entry
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def serving_ports(stage: str | None = None) -> list[int]:
    """Ports of the endpoints this process serves (for one stage, or all)."""
    with _servers_lock:
        return sorted(p for p, (_, _, s) in _servers.items() if stage is None or s == stage)
