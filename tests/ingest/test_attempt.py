from __future__ import annotations

import random

import pytest

from callgate.errors import Reason
from ingest.attempt import (
    AttemptOutcome, GiveUp, GiveUpReason, Retry, RetryPolicy, new_attempt_id, parse_retry_after,
)

POLICY = RetryPolicy(max_attempts=4, base_delay_s=1.0, multiplier=2.0, max_delay_s=5.0, jitter=0.5)


@pytest.mark.parametrize(
    "outcome,retry",
    [
        (AttemptOutcome(Reason.TRANSPORT_CONNECT_ERROR), True),
        (AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=429), True),
        (AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=500), True),
        (AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=503), True),
        (AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=400), False),
        (AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=401), False),
        (AttemptOutcome(Reason.TRANSPORT_IDLE_TIMEOUT, messages=0), True),
        (AttemptOutcome(Reason.TRANSPORT_IDLE_TIMEOUT, messages=3), True),
        (AttemptOutcome(Reason.TRANSPORT_DISCONNECT, messages=0), True),
        (AttemptOutcome(Reason.TRANSPORT_DISCONNECT, messages=1), True),
        (AttemptOutcome(Reason.TRANSPORT_EOF, messages=0), False),
        (AttemptOutcome(Reason.TRANSPORT_EOF, messages=9), False),
        (AttemptOutcome(Reason.TRANSPORT_TOTAL_TIMEOUT), False),
        (AttemptOutcome(Reason.TRANSPORT_CANCELLED), False),
        (AttemptOutcome(Reason.SSE_LINE_TOO_LONG), False),
        (AttemptOutcome(Reason.SSE_MESSAGE_TOO_LARGE), False),
    ],
)
def test_which_endings_retry(outcome: AttemptOutcome, retry: bool) -> None:
    assert POLICY.decide(outcome, 1, random.Random(1)).retry is retry


def test_partial_retry_can_be_turned_off() -> None:
    outcome = AttemptOutcome(Reason.TRANSPORT_DISCONNECT, messages=5)
    assert isinstance(POLICY.decide(outcome, 1), Retry)
    strict = RetryPolicy(retry_after_partial=False)
    assert strict.decide(outcome, 1) == GiveUp(GiveUpReason.NOT_RETRYABLE)
    assert isinstance(strict.decide(AttemptOutcome(Reason.TRANSPORT_DISCONNECT, messages=0), 1), Retry)


def test_max_attempts_is_a_hard_stop() -> None:
    outcome = AttemptOutcome(Reason.TRANSPORT_CONNECT_ERROR)
    assert [POLICY.decide(outcome, n).retry for n in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert POLICY.decide(outcome, 4) == GiveUp(GiveUpReason.ATTEMPTS_EXHAUSTED)
    assert POLICY.decide(AttemptOutcome(Reason.TRANSPORT_EOF), 4) == GiveUp(GiveUpReason.NOT_RETRYABLE)


def test_default_jitter_is_full() -> None:
    rng = random.Random(11)
    delays = [RetryPolicy(base_delay_s=2.0).backoff_s(1, rng) for _ in range(500)]
    assert all(0.0 <= d <= 2.0 for d in delays)
    assert min(delays) < 0.1 and max(delays) > 1.9  # the whole [0, ceiling] range is used


def test_backoff_grows_is_capped_and_jittered() -> None:
    rng = random.Random(7)
    for number, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)):
        delays = [POLICY.backoff_s(number, rng) for _ in range(200)]
        assert all(ceiling * 0.5 <= d <= ceiling for d in delays)
        assert max(delays) - min(delays) > ceiling * 0.2  # actually jittered


def test_retry_after_is_a_floor_with_a_cap() -> None:
    rng = random.Random(3)
    assert POLICY.decide(AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=429, retry_after_s=7),
                         1, rng) == Retry(7)
    capped = RetryPolicy(max_retry_after_s=10).decide(
        AttemptOutcome(Reason.TRANSPORT_HTTP_STATUS, http_status=429, retry_after_s=10_000), 1, rng)
    assert capped == Retry(10)


def test_parse_retry_after() -> None:
    assert parse_retry_after("3", 0) == 3.0
    assert parse_retry_after(None, 0) is None
    assert parse_retry_after("soon", 0) is None
    assert parse_retry_after("-1", 0) is None
    # an HTTP-date 30 s after "now"
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", 1445412480.0) == 30.0


def test_attempt_ids_are_fresh() -> None:
    ids = {new_attempt_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)  # uuid4 hex: opaque, nothing derived
