"""The ingest worker: RunRequests in, one stream per run, raw SSE messages out.

A thin async shell around the sans-I/O decoder and retry policy:

* consumes `callgate.runs` in a consumer group (read_committed, manual commits);
* per run, attempts the stream with httpx until the retry policy says stop;
  each attempt publishes AttemptStarted, then every complete message as a
  RawSseMessage (seq 0, 1, ... per attempt), then always exactly one
  TransportEnd (seq = messages), also on cancellation, keyed by run id to
  `callgate.sse.raw` with an idempotent producer (acks=all);
* commits a run's offset only once every record of all its attempts was
  acknowledged, and only as a contiguous prefix per partition (runs finish
  out of order when several stream at once).

At-least-once: a worker that dies (or is stopped, or loses the partition)
before the commit leaves the run uncommitted, so some worker streams it again
from the start as a *new* attempt with a new id. That is safe because
attempts never mix: the normalizer keys every buffer by attempt, and a new
AttemptStarted supersedes (and quarantines) whatever the old attempt left
open. Nothing is lost; a run may be streamed twice.

Secrets: the API key comes from the environment variable the request names
and goes only into a request header; it is never logged or recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError, MessageSizeTooLargeError

from callgate import avro
from callgate.errors import Reason, RecordError
from callgate.kafka import TopicMissing, make_producer, partition_counts
from callgate.logging import configure_logging, get_logger
from callgate import metrics
from callgate.records import AttemptStarted, RawSseMessage, RunRequest, TransportEnd
from callgate.settings import Settings
from callgate.topics import TopicNames
from ingest.attempt import AttemptOutcome, Decision, Retry, RetryPolicy, new_attempt_id, parse_retry_after
from ingest.decoder import SseDecoder, SseLimitExceeded

STAGE = "ingest"
log = get_logger("callgate.ingest")
UNREGISTERED_ADAPTER = "unregistered"
# One SSE message becomes one Kafka record, and the broker refuses records over message.max.bytes
# (1 MiB by default). A bigger message must end the attempt as classified, not fail the producer:
# a run whose publish fails stays uncommitted and would be re-streamed into the same failure forever.
RECORD_SAFE_MESSAGE_BYTES = 900 * 1024


class _RecordTooLarge(Exception):
    pass


def _now_ms() -> int:
    return int(time.time() * 1000)


def route_adapter_version(route: str) -> str:
    """The normalizer's adapter version for the route: ingest stamps it on every record."""
    try:
        from normalizer.adapters import adapter_version
    except ImportError:  # pragma: no cover - the normalizer package ships with callgate
        return UNREGISTERED_ADAPTER
    try:
        return adapter_version(route)
    except Exception:  # noqa: BLE001 - an unknown route is the normalizer's to classify
        return UNREGISTERED_ADAPTER


@dataclass(frozen=True, slots=True)
class StreamTimeouts:
    connect_s: float = 10.0
    idle_s: float = 60.0  # longest silence between received bytes (httpx read timeout)
    total_s: float = 900.0  # the whole attempt, connect included
    write_s: float = 30.0


@dataclass(frozen=True, slots=True)
class IngestConfig:
    bootstrap: str
    topics: TopicNames
    group_id: str
    max_concurrent_runs: int = 8
    timeouts: StreamTimeouts = StreamTimeouts()
    policy: RetryPolicy = RetryPolicy()
    max_line_bytes: int = RECORD_SAFE_MESSAGE_BYTES
    max_message_bytes: int = RECORD_SAFE_MESSAGE_BYTES
    worker_id: str = ""
    metrics_port: int | None = None  # serve /metrics on 127.0.0.1 when set (0: any free port)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> IngestConfig:
        return cls(
            bootstrap=settings.kafka_bootstrap,
            topics=settings.topics,
            group_id=f"{settings.topic_namespace}-ingest",  # one group per topic namespace
            worker_id=settings.worker_id,
            metrics_port=settings.metrics_port,
            **overrides,
        )


def auth_headers(request: RunRequest, env: Mapping[str, str]) -> dict[str, str]:
    """Provider-style auth from the env var the request names; empty when none is named or set."""
    if not request.api_key_env:
        return {}
    key = env.get(request.api_key_env)
    if not key:
        log.warning("api key variable not set", stage=STAGE, run_id=request.run_id,
                    detail_code="api_key_env_missing")
        return {}
    if request.route.startswith("anthropic"):
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"Authorization": f"Bearer {key}"}


@dataclass(slots=True)
class _PartitionProgress:
    """Offsets taken from one partition, so only a contiguous done prefix is committed."""

    in_flight: set[int] = field(default_factory=set)
    highest_done: int = -1
    committed: int = -1

    def committable(self) -> int | None:
        """The next offset to commit, if it moved."""
        target = min(self.in_flight) if self.in_flight else self.highest_done + 1
        return target if target > self.committed and target > 0 else None


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: IngestWorker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._worker._revoke(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        return None


class IngestWorker:
    def __init__(
        self,
        config: IngestConfig,
        *,
        env: Mapping[str, str] | None = None,
        adapter_version_for: Callable[[str], str] = route_adapter_version,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.env = os.environ if env is None else env
        self.adapter_version_for = adapter_version_for
        self.rng = rng or random.Random()
        self._transport = transport
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._progress: dict[TopicPartition, _PartitionProgress] = {}
        self._revoked: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None
        self.attempts_started = 0
        self.runs_finished = 0

    # -- lifecycle -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        # Subscribing before the topic's metadata is visible yields an empty assignment that
        # aiokafka only revisits at the next metadata refresh (minutes): check first, fail clearly.
        counts = await partition_counts(cfg.bootstrap, [cfg.topics.runs, cfg.topics.sse_raw])
        missing = sorted(topic for topic, count in counts.items() if not count)
        if missing:
            raise TopicMissing(", ".join(missing))
        self._producer = await _make_producer(cfg.bootstrap)
        self._client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(connect=cfg.timeouts.connect_s, read=cfg.timeouts.idle_s,
                                  write=cfg.timeouts.write_s, pool=cfg.timeouts.connect_s),
            limits=httpx.Limits(max_connections=cfg.max_concurrent_runs * 2, max_keepalive_connections=0),
            follow_redirects=False,
        )
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap, group_id=cfg.group_id, isolation_level="read_committed",
            enable_auto_commit=False, auto_offset_reset="earliest",
            metadata_max_age_ms=30_000,  # partitions added to the runs topic are picked up within 30 s
        )
        await self._consumer.start()
        self._consumer.subscribe([cfg.topics.runs], listener=_Rebalance(self))
        log.info("ingest started", stage=STAGE, worker_id=cfg.worker_id, topic=cfg.topics.runs)
        metrics_port = metrics.start_metrics(cfg, STAGE)
        try:
            await self._consume(stop)
        finally:
            metrics.stop_metrics(metrics_port)
            # stopping: in-flight attempts end as cancelled and stay uncommitted (re-streamed later)
            await self._cancel(list(self._tasks))
            with contextlib.suppress(Exception):
                await self._commit()
            await self._consumer.stop()
            await self._client.aclose()
            await self._producer.stop()
            log.info("ingest stopped", stage=STAGE, worker_id=cfg.worker_id)

    async def _consume(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        lag = metrics.LagTracker(STAGE)
        lag_due = 0.0
        paused = False
        try:
            while not stop.is_set():
                if self._fatal is not None:
                    raise RuntimeError("a run failed to publish; see the log") from self._fatal
                if len(self._tasks) >= self.config.max_concurrent_runs:
                    # keep polling while full (so the group keeps us), but take no more runs; paused
                    # again every time because a rebalance hands over partitions unpaused
                    consumer.pause(*consumer.assignment())
                    paused = True
                elif paused:
                    consumer.resume(*consumer.assignment())
                    paused = False
                free = max(1, self.config.max_concurrent_runs - len(self._tasks))
                batches = await consumer.getmany(timeout_ms=200, max_records=free)
                for tp, records in batches.items():
                    for record in records:
                        self._take(tp, record)
                await self._commit()
                if time.monotonic() >= lag_due:
                    lag_due = time.monotonic() + 1.0
                    await lag.update(consumer, consumer.assignment())
        finally:
            lag.clear()

    def _take(self, tp: TopicPartition, record: Any) -> None:
        metrics.record_event(STAGE)
        progress = self._progress.setdefault(tp, _PartitionProgress())
        try:
            request = avro.decode(record.value, topic=record.topic, partition=record.partition, offset=record.offset)
            if not isinstance(request, RunRequest):
                raise RecordError(Reason.UNKNOWN_SCHEMA, "not a run request", topic=record.topic,
                                  partition=record.partition, offset=record.offset)
        except RecordError as exc:
            # a bad record is skipped (and committed past), never a crash loop
            log.error("undecodable run request skipped", stage=STAGE, topic=record.topic,
                      partition=record.partition, offset=record.offset, reason=exc.reason.value)
            progress.highest_done = max(progress.highest_done, record.offset)
            return
        progress.in_flight.add(record.offset)
        task = asyncio.create_task(self._run_and_release(request, tp, record.offset))
        self._tasks[task] = tp

    async def _run_and_release(self, request: RunRequest, tp: TopicPartition, offset: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        completed = False
        try:
            await self.stream_run(request)
            completed = True
        except Exception as exc:  # noqa: BLE001 - e.g. the producer failed: records may be missing
            # the run stays uncommitted; stop the worker so a restart re-streams it as a new attempt
            log.error("run failed; stopping the worker", stage=STAGE, run_id=request.run_id,
                      error_class=type(exc).__name__)
            self._fatal = exc
        finally:
            self._tasks.pop(task, None)
            progress = self._progress.get(tp)
            if completed and progress is not None and task not in self._revoked:
                progress.in_flight.discard(offset)
                progress.highest_done = max(progress.highest_done, offset)
                self.runs_finished += 1
            self._revoked.discard(task)

    async def _commit(self) -> None:
        assert self._consumer is not None
        offsets = {}
        for tp, progress in self._progress.items():
            target = progress.committable()
            if target is not None:
                offsets[tp] = target
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            log.warning("commit failed; runs will be re-streamed", stage=STAGE, error_class=type(exc).__name__)
            return
        for tp, target in offsets.items():
            self._progress[tp].committed = target

    async def _revoke(self, revoked: set[TopicPartition]) -> None:
        """Another worker will own these runs: end our attempts (cancelled) and forget the offsets."""
        tasks = [t for t, tp in self._tasks.items() if tp in revoked]
        self._revoked.update(tasks)
        await self._cancel(tasks)
        with contextlib.suppress(Exception):
            await self._commit()
        for tp in revoked:
            self._progress.pop(tp, None)

    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            self._revoked.add(task)  # a cancelled run is not done: never commit it
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- one run -----------------------------------------------------------------------

    async def stream_run(self, request: RunRequest) -> None:
        """Attempt the run until it succeeds or the policy stops; every record acknowledged on return."""
        attempt_number = 1
        while True:
            outcome, decision = await self._attempt(request, attempt_number)
            if not isinstance(decision, Retry):
                log.info("run finished", stage=STAGE, run_id=request.run_id, attempt=attempt_number,
                         reason=outcome.reason.value, count=outcome.messages, detail_code=decision.reason.value)
                return
            log.info("attempt will be retried", stage=STAGE, run_id=request.run_id, attempt=attempt_number,
                     reason=outcome.reason.value, http_status=outcome.http_status,
                     duration_ms=int(decision.after_s * 1000))
            # backoff. A cancellation here has no open attempt to end: the last TransportEnd said
            # will_retry, and the uncommitted run is streamed again (as new attempts) by its next owner
            await asyncio.sleep(decision.after_s)
            attempt_number += 1

    async def _attempt(self, request: RunRequest, attempt_number: int) -> tuple[AttemptOutcome, Decision]:
        assert self._producer is not None and self._client is not None
        cfg = self.config
        topic = cfg.topics.sse_raw
        key = request.run_id.encode()
        attempt_id = new_attempt_id()
        version = self.adapter_version_for(request.route)
        pending: list[asyncio.Future[Any]] = []
        producer = self._producer

        async def publish(record: Any) -> None:
            pending.append(await producer.send(topic, avro.encode(record), key=key))

        self.attempts_started += 1
        started = asyncio.ensure_future(publish(AttemptStarted(
            run_id=request.run_id, attempt_id=attempt_id, attempt_number=attempt_number, route=request.route,
            adapter_version=version, model=request.model, tool_set=list(request.tool_set),
            policy_id=request.policy_id, started_at=_now_ms(),
        )))
        cancelled: asyncio.CancelledError | None = None
        try:
            # shielded: once the start is queued the attempt must get its end, so never half-send it
            await asyncio.shield(started)
        except asyncio.CancelledError as exc:
            cancelled = exc
            await started  # a send failure raises here, as it would unshielded
        decoder = SseDecoder(max_line_bytes=cfg.max_line_bytes, max_message_bytes=cfg.max_message_bytes)
        seq = 0
        received = 0
        status: int | None = None
        retry_after: float | None = None
        reason = Reason.TRANSPORT_CANCELLED if cancelled is not None else Reason.TRANSPORT_EOF

        async def publish_messages(messages: list[Any], at_ms: int) -> None:
            nonlocal seq
            for message in messages:
                try:
                    await publish(RawSseMessage(
                        run_id=request.run_id, attempt_id=attempt_id, seq=seq, route=request.route,
                        adapter_version=version, received_at=at_ms, event=message.event, data=message.data,
                        last_event_id=message.last_event_id or None, retry_ms=message.retry,
                    ))
                except MessageSizeTooLargeError as exc:  # over the producer's max_request_size
                    raise _RecordTooLarge from exc
                seq += 1

        headers = {"Accept": "text/event-stream", **auth_headers(request, self.env)}
        body = request.request_body or None
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            if cancelled is not None:
                raise cancelled  # cancelled while the start was being queued: end it at once
            async with asyncio.timeout(cfg.timeouts.total_s):
                async with self._client.stream(
                    "POST" if body is not None else "GET", request.upstream_url, content=body, headers=headers
                ) as response:
                    status = response.status_code
                    if not 200 <= status < 300:
                        reason = Reason.TRANSPORT_HTTP_STATUS
                        retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
                    else:
                        async for chunk in response.aiter_bytes():
                            received += len(chunk)
                            try:
                                messages = decoder.feed(chunk)
                            except SseLimitExceeded as exc:
                                await publish_messages(exc.dispatched, _now_ms())
                                reason = exc.reason
                                break
                            if messages:
                                await publish_messages(messages, _now_ms())
        except _RecordTooLarge:
            reason = Reason.SSE_MESSAGE_TOO_LARGE
        except TimeoutError:
            reason = Reason.TRANSPORT_TOTAL_TIMEOUT
        except httpx.ReadTimeout:
            reason = Reason.TRANSPORT_IDLE_TIMEOUT
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol,
                httpx.InvalidURL):
            reason = Reason.TRANSPORT_CONNECT_ERROR
        except httpx.HTTPError:  # RemoteProtocolError, ReadError, WriteError, decoding errors...
            reason = Reason.TRANSPORT_DISCONNECT
        except asyncio.CancelledError as exc:
            reason = Reason.TRANSPORT_CANCELLED
            cancelled = exc
        end = decoder.close()
        outcome = AttemptOutcome(reason, messages=seq, http_status=status, retry_after_s=retry_after)
        decision = cfg.policy.decide(outcome, attempt_number, self.rng)
        final = TransportEnd(
            run_id=request.run_id, attempt_id=attempt_id, seq=seq, route=request.route, reason=reason.value,
            ended_at=_now_ms(), bytes_received=received, messages=seq, http_status=status,
            incomplete_message=end.incomplete, will_retry=isinstance(decision, Retry),
        )
        # the end record goes out even while being cancelled: shield it from a second cancel
        await asyncio.shield(self._finish(publish, final, pending))
        if cancelled is not None:
            raise cancelled
        return outcome, decision

    @staticmethod
    async def _finish(publish: Callable[[Any], Any], final: TransportEnd, pending: list[asyncio.Future[Any]]) -> None:
        await publish(final)
        await asyncio.gather(*pending)  # acknowledged by the broker: only now may the run be committed


async def _make_producer(bootstrap: str) -> AIOKafkaProducer:
    return await make_producer(bootstrap)


async def run_ingest(config: IngestConfig, stop: asyncio.Event, **kw: Any) -> IngestWorker:
    worker = IngestWorker(config, **kw)
    await worker.run(stop)
    return worker


def main(config: IngestConfig | None = None) -> int:
    configure_logging()
    config = config or IngestConfig.from_settings(Settings.from_env())

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_ingest(config, stop)

    asyncio.run(_run())
    return 0
