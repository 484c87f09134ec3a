"""How fresh a connected worker's last_seen_at is kept, and when it counts as silent
(GRADIENT_WORKER_TIMEOUT_SECS)."""

from datetime import datetime, timedelta

from django.conf import settings

# At most this long between a session's writes of last_seen_at: each write is a statement per
# worker, work that grows with the fleet rather than with the jobs.
LONGEST_TOUCH_SECS = 30.0


def touch_every() -> float:
    """Seconds between a live session's writes of last_seen_at: a quarter of the timeout."""
    return min(LONGEST_TOUCH_SECS, settings.GRADIENT["WORKER_TIMEOUT_SECS"] / 4)


def silent_before(now: datetime) -> datetime:
    """A connected worker last seen before this has been silent for the timeout. last_seen_at
    lags a session's last frame by up to one touch period, which is added: a worker that
    sends frames is never taken for silent; a dead one is found at most that much later."""
    timeout = settings.GRADIENT["WORKER_TIMEOUT_SECS"]
    return now - timedelta(seconds=timeout + touch_every())
