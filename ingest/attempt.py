"""The retry policy for one run's attempts: pure, no I/O, no clock.

An attempt ends in exactly one `AttemptOutcome`; `RetryPolicy.decide` answers
`Retry(after_s)` or `GiveUp(reason)`. A retry is always a new attempt with a
new id and a new decoder: nothing of the old one is reused.

Which endings are retried, and why:
* connect errors, and HTTP 408/429/500/502/503/504: nothing was streamed;
* a disconnect or an idle timeout, *also after messages were published*:
  attempts never mix (the normalizer keys every buffer by attempt id, and a
  new AttemptStarted quarantines whatever the old attempt left open), so a
  fresh attempt cannot splice into or duplicate a call of the failed one. The
  cost is one more upstream request, bounded by `max_attempts`. Set
  `retry_after_partial=False` to retry only endings that published nothing;
* never: a clean end of stream (even one that left an unterminated message:
  the server chose to end there, the same request would end the same way), a
  total timeout (the attempt's budget is spent), cancellation, other HTTP
  statuses (4xx are the caller's fault), and framing limit errors (the same
  bytes would break the same limit).

Backoff is exponential with a cap and full jitter (uniform in [0, ceiling] by
default), drawn from a caller-supplied random source so tests are
deterministic, and never shorter than the server's Retry-After, itself capped
so a hostile header cannot park a run.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from enum import StrEnum

from callgate.errors import Reason

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_INTERRUPTED = frozenset({Reason.TRANSPORT_IDLE_TIMEOUT, Reason.TRANSPORT_DISCONNECT})


def new_attempt_id() -> str:
    """Opaque and random: never derived from the run, the number or the content."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    reason: Reason  # a transport Reason, or an SSE limit Reason
    messages: int = 0  # complete messages dispatched (and published) in this attempt
    http_status: int | None = None
    retry_after_s: float | None = None


class GiveUpReason(StrEnum):
    NOT_RETRYABLE = "not_retryable"  # a success, or an ending that another attempt would not fix
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"


@dataclass(frozen=True, slots=True)
class Retry:
    after_s: float
    retry = True  # class attributes: `decision.retry` reads the same for both kinds


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: GiveUpReason
    retry = False


Decision = Retry | GiveUp


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4
    base_delay_s: float = 0.5
    multiplier: float = 2.0
    max_delay_s: float = 20.0
    jitter: float = 1.0  # the delay is drawn from [ceiling * (1 - jitter), ceiling]: 1.0 is full jitter
    max_retry_after_s: float = 60.0
    retry_statuses: frozenset[int] = field(default=RETRYABLE_STATUSES)
    retry_after_partial: bool = True

    def retryable(self, outcome: AttemptOutcome) -> bool:
        reason = outcome.reason
        if reason is Reason.TRANSPORT_CONNECT_ERROR:
            return True
        if reason is Reason.TRANSPORT_HTTP_STATUS:
            return outcome.http_status in self.retry_statuses
        if reason in _INTERRUPTED:
            return outcome.messages == 0 or self.retry_after_partial
        return False

    def backoff_s(self, attempt_number: int, rng: random.Random) -> float:
        """Delay after attempt `attempt_number` (1-based) failed."""
        ceiling = min(self.max_delay_s, self.base_delay_s * self.multiplier ** (attempt_number - 1))
        return rng.uniform(ceiling * (1 - self.jitter), ceiling)

    def decide(self, outcome: AttemptOutcome, attempt_number: int, rng: random.Random | None = None) -> Decision:
        """What follows attempt `attempt_number` (1-based) of a run."""
        if not self.retryable(outcome):
            return GiveUp(GiveUpReason.NOT_RETRYABLE)
        if attempt_number >= self.max_attempts:
            return GiveUp(GiveUpReason.ATTEMPTS_EXHAUSTED)
        delay = self.backoff_s(attempt_number, rng or random.Random())
        if outcome.retry_after_s is not None:
            delay = max(delay, min(outcome.retry_after_s, self.max_retry_after_s))
        return Retry(delay)


def parse_retry_after(value: str | None, now_s: float) -> float | None:
    """Retry-After is delta-seconds or an HTTP-date; anything else is ignored."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now_s)
