"""Blame (protocol.md, "Worker health"): the seat that ended its attempt, and how.

By its rejection, its prepare timeout, its loss with its worker, or a JobFailed that says the
machine failed rather than the job; an aborted survivor is never blamed. The blame is written
and counted against its worker (workers.health) in the transaction that closes the attempt,
so both happen once, together.
"""

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.utils import timezone

from clusters import statements
from clusters.verdict import LOST
from gradient.logs import ids
from workers.health import quarantine_counted

log = logging.getLogger(__name__)

REJECTED = "rejected"
PREPARE_TIMEOUT = "prepare_timeout"
# JobFailed kinds that blame the seat; `permanent` (the job's own fault), the input kinds (the
# cache's) and `aborted`/`canceled` (a hold expired, an abort) do not.
BLAMED_FAILURES = ("transient", "timeout", "corrupt_eval_cache")
# Every blame, as show_worker, the admin and /metrics name them.
BLAMES = (REJECTED, PREPARE_TIMEOUT, LOST, *BLAMED_FAILURES)


def blame_for(failure_kind: str | None) -> str | None:
    """The blame of a seat whose report (a JobFailed, or its loss) ended its attempt."""
    if failure_kind == LOST or failure_kind in BLAMED_FAILURES:
        return failure_kind
    return None


@dataclass(frozen=True)
class Blame:
    how: str  # one of BLAMES
    # The seat's dispatched_job id; None blames every seat that had not accepted (a timeout).
    seat: uuid.UUID | None = None


def blame_seats(attempt_id, blame: Blame, now: datetime | None = None) -> list[int]:
    """Blame the seat(s) that ended the attempt, inside the transaction that closed it, and
    count it against their workers, in one statement; the workers this quarantined."""
    now = now or timezone.now()
    params = {"how": blame.how, "attempt": attempt_id, "seat": blame.seat, "now": now}
    with connection.cursor() as cursor:
        cursor.execute(statements.BLAME_SQL, params)
        counted = cursor.fetchall()
    quarantined = quarantine_counted(counted, blame.how, now)
    if quarantined:
        log.info(
            "quarantined worker(s) %s after attempt %s (%s)",
            quarantined,
            attempt_id,
            blame.how,
            extra=ids(attempt=attempt_id, worker=quarantined),
        )
    return quarantined
