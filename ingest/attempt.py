"""The retry policy for one run's attempts: pure, no I/O, no clock.

An attempt ends in exactly one `AttemptOutcome`; `RetryPolicy.decide` says
whether another attempt follows and after how long. A retry is always a new
attempt with a new id and a new decoder: nothing of the old one is reused.

Which endings are retried, and why:
* connect errors, and HTTP 408/429/500/502/503/504: nothing was streamed, so a
  retry cannot duplicate model output;
* an idle timeout or a disconnect *before the first message*: same reasoning;
* after messages were published, nothing is retried by default: the model
  already produced part of a response, the normalizer quarantines what was
  open, and a fresh request would be a different response; set
  `retry_after_partial` to retry anyway (still as a separate attempt);
* never: a clean end of stream, a total timeout (the run's budget is spent),
  cancellation, other HTTP statuses (4xx are the caller's fault), and framing
  limit errors (the same bytes would break the same limit).

Backoff is exponential with a cap, with jitter drawn from a caller-supplied
random source (so tests are deterministic), and never shorter than the
server's Retry-After (itself capped, so a hostile header cannot park a run).
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

from callgate.errors import Reason

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_BEFORE_FIRST_MESSAGE = frozenset({Reason.TRANSPORT_IDLE_TIMEOUT, Reason.TRANSPORT_DISCONNECT})


def new_attempt_id() -> str:
    """Opaque and random: never derived from the run, the number or the content."""
    return f"att-{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    reason: Reason  # a transport Reason, or an SSE limit Reason
    messages: int = 0  # complete messages dispatched (and published) in this attempt
    http_status: int | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    retry: bool
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4
    base_delay_s: float = 0.5
    multiplier: float = 2.0
    max_delay_s: float = 20.0
    jitter: float = 0.5  # the delay is drawn from [delay * (1 - jitter), delay]
    max_retry_after_s: float = 60.0
    retry_statuses: frozenset[int] = field(default=RETRYABLE_STATUSES)
    retry_after_partial: bool = False

    def retryable(self, outcome: AttemptOutcome) -> bool:
        reason = outcome.reason
        if reason is Reason.TRANSPORT_CONNECT_ERROR:
            return True
        if reason is Reason.TRANSPORT_HTTP_STATUS:
            return outcome.http_status in self.retry_statuses
        if reason in _BEFORE_FIRST_MESSAGE:
            return outcome.messages == 0 or self.retry_after_partial
        return False

    def backoff_s(self, attempt_number: int, rng: random.Random) -> float:
        """Delay after attempt `attempt_number` (1-based) failed."""
        ceiling = min(self.max_delay_s, self.base_delay_s * self.multiplier ** (attempt_number - 1))
        return rng.uniform(ceiling * (1 - self.jitter), ceiling)

    def decide(self, outcome: AttemptOutcome, attempt_number: int, rng: random.Random | None = None) -> Decision:
        if attempt_number >= self.max_attempts or not self.retryable(outcome):
            return Decision(False)
        delay = self.backoff_s(attempt_number, rng or random.Random())
        if outcome.retry_after_s is not None:
            delay = max(delay, min(outcome.retry_after_s, self.max_retry_after_s))
        return Decision(True, delay)


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
