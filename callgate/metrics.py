"""Prometheus metrics shared by every worker.

Labels are low-cardinality by construction: stage, route, final state and
reason class (closed enums). Provider event types, tool names and ids never
become labels: an attacker-chosen event name would otherwise blow up the
series count and leak content into monitoring.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
CONSUMER_LAG = Gauge(
    "callgate_consumer_lag_records",
    "Records between the stage's position and the partition's last stable offset.",
    ("stage", "topic", "partition"),
    registry=REGISTRY,
)


def record_decision(stage: str, state: str, reason: str | None) -> None:
    ITEMS_FINAL.labels(stage=stage, state=state, reason=reason or "none").inc()


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Expose /metrics on a background thread; returns the bound port (0 picks a free one)."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return int(server.server_address[1])
