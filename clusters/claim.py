"""The spec's Claim and Close: every cluster write that must be one transaction.

Lock order, so that two of these never wait on each other in a circle: an existing attempt
first, then its dispatched_job rows, then its cluster_job, then the member jobs. A claim locks
its cluster first, but only to insert a new attempt, which conflicts with no existing one
(ON CONFLICT DO NOTHING returns at once), and claims its members in job-key order.
"""

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterStatus
from gradient.jobs.claim import Assignment, claim_assignments
from gradient.jobs.models import BuildStatus, DispatchedOutcome, EvaluationStatus, JobKind
from gradient.jobs.transitions import advance_builds, advance_evaluations

log = logging.getLogger(__name__)


@dataclass
class ClusterClaim:
    cluster_id: int
    # One assignment per member, each with its own gate (job key and start condition).
    members: list[Assignment]
    attempt_id: uuid.UUID = field(default_factory=uuid.uuid4)
    now: datetime = field(default_factory=timezone.now)
    # The seats' idle slots (worker id, kind), taken in the same step: the claim is refused
    # when one is gone or older than `idle_since` (its worker went busy since the snapshot).
    idle_seats: list[tuple[int, str]] = field(default_factory=list)
    idle_since: datetime | None = None


class _Lost(Exception):
    """Raised inside the claim transaction to roll every statement back."""


def bound_lock_waits() -> None:
    # A frozen rival holding a row lock must cost this claimer a bounded wait, not a hang.
    ms = int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"])
    with connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = {ms}")


OPEN_ATTEMPT_SQL = """
INSERT INTO cluster_attempt (id, cluster_job_id, created_at)
SELECT %s, %s, %s
WHERE EXISTS (SELECT 1 FROM cluster_job WHERE id = %s AND status = %s FOR SHARE)
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING id
"""


def claim_cluster(claim: ClusterClaim) -> bool:
    """Open an attempt and claim every member in one transaction; False writes nothing.

    The attempt is inserted only while the cluster is Queued, and idx-cluster_attempt-open
    makes a second claimer insert nothing. Each member then goes through the single-assignment
    claim; the first that inserts nothing (the job is open elsewhere, or cannot start) rolls
    the whole attempt back. Build members get their Assigned transition in the same step.
    """
    if not claim.members:
        return False
    try:
        with transaction.atomic(durable=True):
            bound_lock_waits()
            if claim.idle_seats and not _take_idle_seats(claim):
                raise _Lost
            with connection.cursor() as cursor:
                cursor.execute(
                    OPEN_ATTEMPT_SQL,
                    [
                        claim.attempt_id,
                        claim.cluster_id,
                        claim.now,
                        claim.cluster_id,
                        ClusterStatus.QUEUED.value,
                    ],
                )
                if cursor.fetchone() is None:
                    raise _Lost
            # Canonical key order: overlapping claimers queue on the same key first. The
            # members go in one round trip; any that inserts nothing loses the whole claim.
            members = sorted(claim.members, key=lambda m: m.gate.key)
            for member in members:
                member.cluster_attempt_id = claim.attempt_id
                member.dispatched_at = claim.now
            if not claim_assignments(members):
                raise _Lost
            builds = [m.gate.job for m in claim.members if m.gate.kind == JobKind.BUILD]
            if advance_builds(builds, BuildStatus.BUILDING, {BuildStatus.QUEUED}) != len(builds):
                raise _Lost
    except _Lost:
        return False
    except OperationalError as exc:
        # lock_timeout: a rival holds what we need; losing is the safe answer.
        log.warning("claim of cluster %s lost on a lock wait: %s", claim.cluster_id, exc)
        return False
    return True


def _take_idle_seats(claim: ClusterClaim) -> bool:
    workers = [w for w, _ in claim.idle_seats]
    kinds = [k for _, k in claim.idle_seats]
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM idle_slot s USING unnest(%s::bigint[], %s::text[]) AS t(worker, kind)"
            " WHERE s.worker_id = t.worker AND s.kind = t.kind AND s.recorded_at >= %s",
            [workers, kinds, claim.idle_since],
        )
        return cursor.rowcount == len(claim.idle_seats)


def close_attempt_rows(
    attempt_id, outcome: str, now: datetime, *, unstarted: bool = False
) -> int | None:
    """Close an open attempt and abandon its open member rows; the cluster id, or None when
    the attempt was not open (nothing touched)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE cluster_attempt SET finished_at = %s, outcome = %s"
            " WHERE id = %s AND finished_at IS NULL"
            + (" AND started_at IS NULL" if unstarted else "")
            + " RETURNING cluster_job_id",
            [now, outcome, attempt_id],
        )
        row = cursor.fetchone()
        if row is None:
            return None
        cursor.execute(
            "UPDATE dispatched_job SET finished_at = %s, outcome = %s"
            " WHERE cluster_attempt_id = %s AND finished_at IS NULL",
            [now, DispatchedOutcome.ABANDONED.value, attempt_id],
        )
    return row[0]


def _member_jobs(attempt_id) -> tuple[list, list]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT evaluation_id, derivation_build_id FROM dispatched_job"
            " WHERE cluster_attempt_id = %s",
            [attempt_id],
        )
        rows = cursor.fetchall()
    return [e for e, _ in rows if e], [b for _, b in rows if b]


def release_members(attempt_id) -> None:
    """Hand the attempt's member jobs back to the queue: builds undo their Assigned
    transition, started evaluations go back to Queued."""
    evaluations, builds = _member_jobs(attempt_id)
    advance_builds(builds, BuildStatus.QUEUED, {BuildStatus.BUILDING})
    advance_evaluations(evaluations, EvaluationStatus.QUEUED, {EvaluationStatus.EVALUATING_FLAKE})


def set_cluster_status(cluster_id, status: str, now: datetime, *, only_from=None) -> bool:
    sql = "UPDATE cluster_job SET status = %s, updated_at = %s WHERE id = %s"
    params = [status, now, cluster_id]
    if only_from:
        sql += " AND status = ANY(%s)"
        params.append(list(only_from))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def close_cluster_attempt(attempt_id, outcome: str) -> bool:
    """Close an open attempt with its outcome, abandoning every open member row with it.

    A second close (a prepare timeout racing a member failure) returns False and touches
    nothing.
    """
    with transaction.atomic(durable=True):
        bound_lock_waits()
        return close_attempt_rows(attempt_id, outcome, timezone.now()) is not None


def start_cluster_attempt(attempt_id) -> bool:
    """Mark an open, unstarted attempt started; its cluster goes Running and counts it.

    Counting here, not at the claim, is what keeps a failed prepare off the retry budget.
    """
    now = timezone.now()
    with transaction.atomic(durable=True):
        bound_lock_waits()
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE cluster_attempt SET started_at = %s WHERE id = %s"
                " AND started_at IS NULL AND finished_at IS NULL RETURNING cluster_job_id",
                [now, attempt_id],
            )
            row = cursor.fetchone()
            if row is None:
                return False
            cursor.execute(
                "UPDATE cluster_job SET status = %s, attempts = attempts + 1, updated_at = %s"
                " WHERE id = %s",
                [ClusterStatus.RUNNING.value, now, row[0]],
            )
        # Member evaluations now run (builds went Building at the claim).
        evaluations, _ = _member_jobs(attempt_id)
        advance_evaluations(
            evaluations, EvaluationStatus.EVALUATING_FLAKE, {EvaluationStatus.QUEUED}
        )
    return True


def fail_prepare_attempt(attempt_id) -> bool:
    """A reject, a prepare timeout or a held member's failure: close the unstarted attempt
    PrepareFailed and hand its builds back. The cluster stays Queued (it never left it), and
    the backoff runs from this attempt's finished_at. False if the attempt had started or
    was closed already."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        if close_attempt_rows(
            attempt_id, AttemptOutcome.PREPARE_FAILED, timezone.now(), unstarted=True
        ):
            release_members(attempt_id)
            return True
    return False


def resolve_cluster_attempt(attempt_id, outcome: str, *, retry: bool, finished: str) -> bool | None:
    """Settle a decided attempt in one transaction: close it with `outcome`, then requeue its
    cluster when `retry` holds and the budget and its members allow, else finish it as
    `finished`. None when the attempt was closed already; otherwise whether it requeued."""
    now = timezone.now()
    with transaction.atomic(durable=True):
        bound_lock_waits()
        cluster_id = close_attempt_rows(attempt_id, outcome, now)
        if cluster_id is None:
            return None
        requeued = retry and can_retry(cluster_id)
        if requeued:
            release_members(attempt_id)
            set_cluster_status(cluster_id, ClusterStatus.QUEUED, now)
        else:
            set_cluster_status(cluster_id, finished, now)
        return requeued


DEAD_MEMBERS_SQL = """
SELECT count(*) FROM cluster_member m
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
WHERE m.cluster_job_id = %s
  AND (e.status = ANY(%s) OR b.status = ANY(%s))
"""


def dead_member_count(cluster_id) -> int:
    """Members that can no longer start: their evaluation or build reached a final state.
    (A deleted job deletes its member row, so it cannot be counted here; see has_members.)"""
    from gradient.jobs.models import BUILD_TERMINAL, EVALUATION_TERMINAL

    with connection.cursor() as cursor:
        cursor.execute(
            DEAD_MEMBERS_SQL,
            [cluster_id, sorted(EVALUATION_TERMINAL), sorted(BUILD_TERMINAL)],
        )
        return cursor.fetchone()[0]


def can_retry(cluster_id) -> bool:
    """Budget left (retries so far = started attempts - 1) and every member can still start."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attempts, retry_budget FROM cluster_job WHERE id = %s FOR UPDATE",
            [cluster_id],
        )
        attempts, budget = cursor.fetchone()
    return attempts - 1 < budget and dead_member_count(cluster_id) == 0
