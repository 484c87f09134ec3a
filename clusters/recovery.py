"""Recovery sweeps: bring every cluster back to a consistent state from the database alone.

Safe to run at start-up and at any time, from any number of processes at once: each step is
one of the claim module's transactions, which re-check what they change. Deadlines are
computed from stored times (an attempt's created_at), so a restart never resets one.
"""

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from clusters.claim import (
    RELEASED_FROM,
    bound_lock_waits,
    can_retry,
    close_cluster_attempt,
    dead_member_count,
    set_cluster_status,
)
from clusters.coordinator import abort_prepare, notify_abort
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.verdict import ABORTING_FAILURES, MemberState, Verdict, decide
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BUILD_TERMINAL,
    EVALUATION_TERMINAL,
    BuildStatus,
    DispatchedJob,
    DispatchedOutcome,
    EvaluationStatus,
)
from gradient.jobs.transitions import BUILD_SOURCES, EVALUATION_SOURCES
from gradient.logs import ids

log = logging.getLogger(__name__)


def expire_overdue_prepares(now=None) -> list:
    """Open, unstarted attempts past their prepare deadline close PrepareFailed."""
    now = now or timezone.now()
    deadline = now - timedelta(seconds=settings.GRADIENT["CLUSTER_PREPARE_TIMEOUT_SECS"])
    overdue = ClusterAttempt.objects.filter(
        finished_at__isnull=True, started_at__isnull=True, created_at__lt=deadline
    ).values_list("pk", flat=True)
    return [pk for pk in overdue if abort_prepare(pk, "prepare timed out")]


STARTED_WITH_LOST_OR_DEAD_SQL = """
SELECT a.id,
       bool_or(e.status = ANY(%(dead_evals)s) OR b.status = ANY(%(dead_builds)s)) AS dead,
       bool_or(d.id IS NULL OR w.channel_name IS NULL OR w.last_seen_at < %(silent)s) AS lost
FROM cluster_attempt a
JOIN cluster_member m ON m.cluster_job_id = a.cluster_job_id
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
LEFT JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.finished_at IS NULL
    AND d.job_id = CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
                        ELSE 'build:' || m.derivation_build_id::text END
LEFT JOIN worker w ON w.id = d.worker_id
WHERE a.finished_at IS NULL AND a.started_at IS NOT NULL
GROUP BY a.id
"""


def resolve_orphaned_attempts(now=None) -> list:
    """Started attempts whose members are gone resolve: a member job aborted or finished
    outside the attempt aborts it; a member whose worker went silent fails it, with a retry
    when the budget allows."""
    from gradient.jobs.models import BUILD_TERMINAL, EVALUATION_TERMINAL

    now = now or timezone.now()
    silent = now - timedelta(seconds=settings.GRADIENT["WORKER_TIMEOUT_SECS"])
    with connection.cursor() as cursor:
        cursor.execute(
            STARTED_WITH_LOST_OR_DEAD_SQL,
            {
                "dead_evals": sorted(EVALUATION_TERMINAL),
                "dead_builds": sorted(BUILD_TERMINAL),
                "silent": silent,
            },
        )
        rows = cursor.fetchall()
    resolved = []
    for attempt_id, dead, lost in rows:
        if dead:
            decided = abort_attempt(attempt_id, "a member's job was aborted")
        else:
            decided = lost and _report_silent_members(attempt_id, silent)
        if decided:
            resolved.append(attempt_id)
    return resolved


def _report_silent_members(attempt_id, silent) -> bool:
    """Members whose worker is gone or silent report as lost into the verdict."""
    lost = DispatchedJob.objects.filter(
        Q(worker__channel_name__isnull=True) | Q(worker__last_seen_at__lt=silent),
        cluster_attempt_id=attempt_id,
        finished_at__isnull=True,
    ).values_list("pk", "worker_id", "job_id")
    decided = False
    for pk, worker_id, job_id in lost:
        with contextlib.suppress(NotAllowed):
            decided = member_report(worker_id, job_id, pk, "Failed", "lost") is not None or decided
    return decided


def settle_running_without_attempt() -> list:
    """A Running cluster always has a started, open attempt; one without it (a crash between
    processes' steps) ends Aborted with a dead member, Failed with a spent budget, else
    goes back to Queued."""
    open_attempt = ClusterAttempt.objects.filter(
        cluster_job=OuterRef("pk"), finished_at__isnull=True
    )
    stranded = ClusterJob.objects.filter(
        ~Exists(open_attempt), status=ClusterStatus.RUNNING
    ).values_list("pk", flat=True)
    settled = []
    for cluster_id in stranded:
        with transaction.atomic(durable=True):
            bound_lock_waits()
            if ClusterAttempt.objects.filter(
                cluster_job_id=cluster_id, finished_at__isnull=True
            ).exists():
                continue
            if dead_member_count(cluster_id):
                status = ClusterStatus.ABORTED
            elif can_retry(cluster_id):
                status = ClusterStatus.QUEUED
            else:
                status = ClusterStatus.FAILED
            if set_cluster_status(cluster_id, status, timezone.now(), only_from={"Running"}):
                settled.append(cluster_id)
    return settled


def recover(now=None) -> dict:
    """Every sweep, in the order that lets each see the previous one's result."""
    result = {
        "expired": expire_overdue_prepares(now),
        "resolved": resolve_orphaned_attempts(now),
        "settled": settle_running_without_attempt(),
    }
    if any(result.values()):
        log.info("cluster recovery: %s", {k: len(v) for k, v in result.items()})
    return result


# Reports -> verdict -> settle every member (the spec's Recovery section).

ATTEMPT_OUTCOME = {
    Verdict.COMPLETE: AttemptOutcome.SUCCEEDED,
    Verdict.RETRY: AttemptOutcome.FAILED,
    Verdict.FAIL: AttemptOutcome.FAILED,
    Verdict.ABORT: AttemptOutcome.ABORTED,
}
CLUSTER_STATUS = {
    Verdict.COMPLETE: ClusterStatus.COMPLETED,
    Verdict.RETRY: ClusterStatus.QUEUED,
    Verdict.FAIL: ClusterStatus.FAILED,
    Verdict.ABORT: ClusterStatus.ABORTED,
}
# Every member row of an attempt with what the verdict reads (its state: key, primary,
# outcome, failure kind, and dead: its job final or gone) and the attempt and cluster it
# belongs to, in job-key order. {attempt} is the attempt's id, or REPORTED_ATTEMPT.
MEMBERS_SQL = """
SELECT a.id, a.cluster_job_id, a.started_at IS NOT NULL, a.finished_at IS NOT NULL,
       c.attempts, c.retry_budget,
       d.id, d.job_id, d.worker_id, d.evaluation_id, d.derivation_build_id, d.finished_at,
       d.outcome, d.failure_kind,
       EXISTS (SELECT 1 FROM cluster_member m
               WHERE m.cluster_job_id = a.cluster_job_id AND m."primary"
                 AND (m.evaluation_id = d.evaluation_id
                      OR m.derivation_build_id = d.derivation_build_id)),
       coalesce(coalesce(e.status, b.status) = ANY(%(dead)s), true)
FROM cluster_attempt a
JOIN cluster_job c ON c.id = a.cluster_job_id
JOIN dispatched_job d ON d.cluster_attempt_id = a.id
LEFT JOIN evaluation e ON e.id = d.evaluation_id
LEFT JOIN derivation_build b ON b.id = d.derivation_build_id
WHERE a.id = {attempt}
ORDER BY d.job_id
"""
ATTEMPT_MEMBERS_SQL = MEMBERS_SQL.format(attempt="%(attempt)s")

# A member's report opens its transaction with these four statements, sent together (a
# psycopg pipeline: one round trip). Each runs on a snapshot taken when it starts, so the
# ones after the lock see every report committed before it.
# The reporting row's attempt: the row is this worker's, of this job, under this id.
REPORTED_ATTEMPT = """(SELECT cluster_attempt_id FROM dispatched_job
                       WHERE id = %(id)s AND worker_id = %(worker)s AND job_id = %(job)s)"""
# bound_lock_waits, for a member's row only: an assignment that is no member's (a single's
# JobFailed, handled in the same transaction) keeps its lock waits as they were.
BOUND_LOCK_WAITS_SQL = f"""
SELECT set_config('lock_timeout', %(lock_timeout)s, true) WHERE {REPORTED_ATTEMPT} IS NOT NULL
"""
# Reports of one attempt queue on its row (settling and abort_attempt lock it first too).
LOCK_ATTEMPT_SQL = f"SELECT 1 FROM cluster_attempt WHERE id = {REPORTED_ATTEMPT} FOR UPDATE"
# The row finishes with the report if it is open, and a Completed only once the attempt has
# started; the row comes back when it did.
FINISH_SQL = """
UPDATE dispatched_job d SET finished_at = %(now)s, outcome = %(outcome)s, failure_kind = %(kind)s
FROM cluster_attempt a
WHERE d.id = %(id)s AND d.worker_id = %(worker)s AND d.job_id = %(job)s AND d.finished_at IS NULL
  AND a.id = d.cluster_attempt_id AND (a.started_at IS NOT NULL OR %(outcome)s <> 'Completed')
RETURNING d.id
"""
# The verdict's input, the report included; no row for an assignment that is no member's.
REPORTED_MEMBERS_SQL = MEMBERS_SQL.format(attempt=REPORTED_ATTEMPT)

# Settling, in the lock order of clusters.claim (the attempt, locked already, then its rows,
# its cluster, the member jobs): close_cluster_attempt (close, abandon the open rows, set the
# cluster: one statement), then in one round trip (a pipeline) each member's guarded
# transition (advance_build, advance_evaluation): per job, a target and the states it may be
# reached from.
MOVE_JOBS_SQL = """
UPDATE {table} j SET status = t.status
FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS t(id, status, sources)
WHERE j.id = t.id AND j.status = ANY(string_to_array(t.sources, ','))
"""
MOVE_SQL = {
    "build": MOVE_JOBS_SQL.format(table="derivation_build"),
    "eval": MOVE_JOBS_SQL.format(table="evaluation"),
}


@dataclass(frozen=True)
class Member:
    """A member's dispatched_job row, as the verdict reads it and settling moves its job."""

    id: uuid.UUID
    job_id: str
    worker_id: int
    evaluation_id: uuid.UUID | None
    derivation_build_id: uuid.UUID | None
    finished_at: datetime | None
    outcome: str | None
    failure_kind: str | None
    primary: bool
    dead: bool

    @property
    def state(self) -> MemberState:
        outcome = self.outcome if self.outcome in ("Completed", "Failed") else None
        return MemberState(self.job_id, self.primary, outcome, self.failure_kind, self.dead)


@dataclass(frozen=True)
class Attempt:
    """An attempt under its lock, with its members, as MEMBERS_SQL reads them."""

    id: uuid.UUID
    cluster_id: int
    started: bool
    closed: bool
    budget_left: bool
    members: list[Member]

    @classmethod
    def from_rows(cls, rows) -> "Attempt":
        attempt_id, cluster_id, started, closed, attempts, budget = rows[0][:6]
        members = [Member(*row[6:]) for row in rows]
        return cls(attempt_id, cluster_id, started, closed, attempts - 1 < budget, members)


def _send(sql: str, params):
    """Execute on a cursor of its own: in a pipeline, its result is read after the sync."""
    cursor = connection.cursor()
    cursor.execute(sql, params)
    return cursor


def _dead_statuses() -> list[str]:
    return sorted(EVALUATION_TERMINAL | BUILD_TERMINAL)


def attempt_members(attempt_id) -> list[Member]:
    with connection.cursor() as cursor:
        cursor.execute(ATTEMPT_MEMBERS_SQL, {"attempt": attempt_id, "dead": _dead_statuses()})
        rows = cursor.fetchall()
    return Attempt.from_rows(rows).members if rows else []


def _job_moves(verdict: Verdict, members: list[Member]) -> dict[str, list[tuple]]:
    """(job, target, its sources) per member job, by kind."""
    moves: dict[str, list[tuple]] = {"build": [], "eval": []}
    for m in members:
        if verdict == Verdict.RETRY:
            to_build, to_eval = BuildStatus.QUEUED, EvaluationStatus.QUEUED
        elif m.outcome == "Completed":
            to_build, to_eval = BuildStatus.COMPLETED, EvaluationStatus.COMPLETED
        elif m.outcome == "Failed" and m.failure_kind not in ABORTING_FAILURES:
            # Settled for good: a requeueing kind becomes permanent.
            to_build, to_eval = BuildStatus.FAILED_PERMANENT, EvaluationStatus.FAILED
        else:  # a survivor, still running when the attempt was decided
            to_build, to_eval = BuildStatus.ABORTED, EvaluationStatus.ABORTED
        if m.derivation_build_id:
            kind, job, to, sources = "build", m.derivation_build_id, to_build, BUILD_SOURCES
        elif m.evaluation_id:
            kind, job, to, sources = "eval", m.evaluation_id, to_eval, EVALUATION_SOURCES
        else:
            continue  # its job is gone
        allowed = sources[to] & RELEASED_FROM[kind] if verdict == Verdict.RETRY else sources[to]
        moves[kind].append((job, to, ",".join(sorted(allowed))))
    return moves


def settle(attempt_id, cluster_id, verdict: Verdict, members: list[Member]) -> list[int]:
    """Apply a decided verdict inside the caller's transaction, the attempt locked: close the
    attempt (abandoning open member rows), set the cluster, settle every member's job. Returns
    the workers of the survivors, to be told AbortCluster after commit."""
    survivors = sorted({m.worker_id for m in members if m.finished_at is None})
    now = timezone.now()
    close_cluster_attempt(
        attempt_id, ATTEMPT_OUTCOME[verdict], now, cluster_status=CLUSTER_STATUS[verdict]
    )
    with connection.wrap_database_errors, connection.connection.pipeline():
        for kind, moves in _job_moves(verdict, members).items():
            if moves:
                _send(MOVE_SQL[kind], [list(column) for column in zip(*moves, strict=True)])
    log.info(
        "attempt %s decided %s",
        attempt_id,
        verdict,
        extra=ids(cluster=cluster_id, attempt=attempt_id),
    )
    return survivors


def _record_report(worker_id, job_id, assignment_id, outcome, kind) -> tuple[Attempt, bool] | None:
    """The report's statements up to the verdict, in one round trip: the attempt locked, the
    row finished if the report may finish it. None when the assignment is no member's held by
    this worker; else the attempt as they left it and whether the row finished."""
    params = {
        "id": assignment_id,
        "worker": worker_id,
        "job": job_id,
        "now": timezone.now(),
        "outcome": outcome,
        "kind": kind,
        "lock_timeout": str(int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"])),
        "dead": _dead_statuses(),
    }
    with connection.wrap_database_errors, connection.connection.pipeline():
        _send(BOUND_LOCK_WAITS_SQL, params)
        _send(LOCK_ATTEMPT_SQL, params)
        finish = _send(FINISH_SQL, params)
        members = _send(REPORTED_MEMBERS_SQL, params)
    rows = members.fetchall()
    if not rows:
        return None
    return Attempt.from_rows(rows), finish.fetchone() is not None


def _refuse_unless_settled(attempt: Attempt, assignment_id, job_id: str) -> None:
    """A report that finished nothing is accepted for a row the decided verdict settled, else
    NotAllowed."""
    row = next(m for m in attempt.members if str(m.id) == str(assignment_id))
    if row.finished_at is None:
        raise NotAllowed(f"{job_id} must not run before StartCluster")
    if not (attempt.closed and row.outcome == DispatchedOutcome.ABANDONED):
        raise NotAllowed(f"{job_id} was reported already")


def _resolve(attempt: Attempt) -> tuple[Verdict | None, list[int]]:
    """The verdict of the reports so far, settled when there is one; the survivors."""
    verdict = decide([m.state for m in attempt.members], budget_left=attempt.budget_left)
    if verdict is None:
        return None, []
    return verdict, settle(attempt.id, attempt.cluster_id, verdict, attempt.members)


def member_report(
    worker_id: int,
    job_id: str,
    assignment_id,
    outcome: str,
    kind: str | None = None,
    *,
    single: Callable[[], None] | None = None,
) -> Verdict | None:
    """A member's JobCompleted/JobFailed (or its loss, outcome Failed with kind "lost").

    Releases its job without moving it; the first deciding report resolves the attempt and
    settles every member, in the same transaction. Before the start, a failure is a failed
    prepare and never reaches the job. A report for a member the verdict already settled is
    accepted and changes nothing. An assignment that is no member's is NotAllowed, or goes to
    `single`, called in the same transaction (a JobFailed tells a single's from a member's at
    no extra round trip)."""
    verdict, survivors = None, []
    with transaction.atomic(durable=True):
        recorded = _record_report(worker_id, job_id, assignment_id, outcome, kind)
        if recorded is None:
            if single is None:
                raise NotAllowed(
                    f"{job_id} is not a member held by this worker under {assignment_id}"
                )
            single()
            return None
        attempt, finished = recorded
        if not finished:
            _refuse_unless_settled(attempt, assignment_id, job_id)
            return None
        if attempt.started:
            verdict, survivors = _resolve(attempt)
    if not attempt.started:
        abort_prepare(attempt.id, f"member {job_id} failed before the start ({kind})")
    elif survivors:
        notify_abort(attempt.id, f"attempt decided: {verdict}", survivors)
    return verdict


def report_lost_members(worker_id: int) -> int:
    """The worker is gone: each of its open member rows reports into its attempt's verdict
    (a failed prepare before the start)."""
    rows = DispatchedJob.objects.filter(
        worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=False
    ).values_list("pk", "job_id")
    for pk, job_id in rows:
        with contextlib.suppress(NotAllowed):  # decided meanwhile
            member_report(worker_id, job_id, pk, "Failed", "lost")
    return len(rows)


def abort_attempt(attempt_id, reason: str) -> bool:
    """An evaluation abort reached a member (or an operator aborted the cluster): the open
    attempt is decided Abort, survivors end Aborted and are told. False if already closed."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        attempt = ClusterAttempt.objects.select_for_update().get(pk=attempt_id)
        if attempt.finished_at is not None:
            return False
        rows = attempt_members(attempt.pk)
        survivors = settle(attempt.pk, attempt.cluster_job_id, Verdict.ABORT, rows)
    notify_abort(attempt_id, reason, survivors)
    return True
