"""Worker health (protocol.md, "Worker health"): blamed seats in a row, and quarantine.

An automatic quarantine leaves the streak as it was, so once lifted the worker is on
probation: its next blamed seat quarantines it again, until a seat of it succeeds. An
operator's lasts until released, and a release clears the streak. Single jobs still reach a
quarantined worker.
"""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from gradient.jobs.models import DispatchedJob
from workers.models import Worker

OPERATOR, AUTOMATIC = "operator", "automatic"
# An operator's quarantine ends only with --release.
FOREVER = datetime(9999, 12, 31, tzinfo=UTC)


def quarantined_q(now: datetime) -> Q:
    """The workers quarantined at `now`, for the ORM."""
    return Q(quarantined_until__gt=now)


def is_quarantined(worker: Worker, now: datetime) -> bool:
    return worker.quarantined_until is not None and worker.quarantined_until > now


def quarantine_due(blamed_in_row: int, quarantined: bool, after: int) -> bool:
    """Whether a worker's blamed seats in a row, counted with its latest, quarantine it now."""
    return after > 0 and not quarantined and blamed_in_row >= after


def on_probation(worker: Worker, now: datetime) -> bool:
    """Lifted from an automatic quarantine, no seat succeeded since: a blamed seat quarantines."""
    after = settings.GRADIENT["QUARANTINE_AFTER"]
    return (
        worker.quarantined_by == AUTOMATIC
        and not is_quarantined(worker, now)
        and quarantine_due(worker.blamed_in_row, False, after)
    )


@dataclass(frozen=True)
class Quarantine:
    since: datetime
    reason: str | None
    by: str


def quarantine_of(worker: Worker, now: datetime) -> Quarantine | None:
    if not is_quarantined(worker, now):
        return None
    return Quarantine(worker.quarantined_since, worker.quarantine_reason, worker.quarantined_by)


def quarantine_counted(counted, blame: str, now: datetime) -> list[int]:
    """COUNT_BLAMED_SQL's rows (worker, its blamed seats in a row, quarantined now) in, the
    workers they quarantine automatically out, written under the count's lock."""
    after = settings.GRADIENT["QUARANTINE_AFTER"]
    due = sorted(
        w for w, streak, quarantined in counted if quarantine_due(streak, quarantined, after)
    )
    if due:
        Worker.objects.filter(pk__in=due).update(
            quarantined_since=now,
            quarantined_until=now + timedelta(seconds=settings.GRADIENT["QUARANTINE_SECS"]),
            quarantined_by=AUTOMATIC,
            quarantine_reason=f"{after} blamed seats in a row, the last {blame}",
        )
    return due


def quarantine(worker: Worker, reason: str | None, now: datetime | None = None) -> None:
    """An operator's quarantine, until released. One already in force keeps its start."""
    now = now or timezone.now()
    Worker.objects.filter(pk=worker.pk).update(
        quarantined_since=Case(
            When(quarantined_q(now), then=F("quarantined_since")), default=Value(now)
        ),
        quarantined_until=FOREVER,
        quarantined_by=OPERATOR,
        quarantine_reason=reason,
    )


def release(worker: Worker) -> None:
    """An operator's release, of either kind of quarantine: no probation follows."""
    Worker.objects.filter(pk=worker.pk).update(
        blamed_in_row=0,
        quarantined_since=None,
        quarantined_until=None,
        quarantined_by=None,
        quarantine_reason=None,
    )


RECENT_SEATS = 20


def seat_rows(worker_id: int, limit: int = RECENT_SEATS) -> list[dict]:
    """The worker's latest cluster seats, newest first."""
    return list(
        DispatchedJob.objects.filter(worker_id=worker_id, cluster_attempt__isnull=False)
        .order_by("-dispatched_at", "-id")
        .values(
            "job_id",
            "outcome",
            "blame",
            "dispatched_at",
            attempt=F("cluster_attempt_id"),
            cluster=F("cluster_attempt__cluster_job_id"),
        )[:limit]
    )
