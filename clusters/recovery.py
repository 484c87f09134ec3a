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
    close_cluster_attempt,
    set_cluster_status,
)
from clusters.coordinator import abort_prepare, notify_abort
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.verdict import (
    LOST,
    MemberState,
    Settlement,
    Verdict,
    budget_left,
    decide,
    member_moves,
)
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
    """Started attempts whose members are gone resolve through the verdict: a member job
    that reached a final state outside the attempt decides it (Abort for an aborted job,
    else Fail), even when its worker never confirms; a member whose worker went silent
    reports as lost."""
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
        decided = dead and resolve_attempt(attempt_id, "a member's job ended outside the attempt")
        if not decided and lost:
            decided = _report_silent_members(attempt_id, silent)
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
            decided = member_report(worker_id, job_id, pk, "Failed", LOST) is not None or decided
    return decided


# A cluster's members as the verdict reads a lost one, the cluster locked; no rows once it
# has an open attempt or is no longer Running.
STRANDED_MEMBERS_SQL = """
WITH c AS (
    SELECT id, attempts, retry_budget FROM cluster_job
    WHERE id = %(cluster)s AND status = %(running)s
      AND NOT EXISTS (SELECT 1 FROM cluster_attempt a
                      WHERE a.cluster_job_id = %(cluster)s AND a.finished_at IS NULL)
    FOR UPDATE
)
SELECT c.attempts, c.retry_budget,
       CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
            ELSE 'build:' || m.derivation_build_id::text END,
       m.evaluation_id, m.derivation_build_id, m."primary",
       coalesce(e.status, b.status) = ANY(%(dead)s),
       coalesce(e.status, b.status) = ANY(%(aborted)s)
FROM c
LEFT JOIN cluster_member m ON m.cluster_job_id = c.id
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
ORDER BY 3
"""


def settle_running_without_attempt() -> list:
    """A Running cluster always has a started, open attempt. One without it (a crash between
    processes' steps) lost every member without a verdict: each reports as lost, and the
    verdict settles the cluster and its member jobs as it would an attempt's."""
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
            with connection.cursor() as cursor:
                params = _statuses(cluster=cluster_id, running=ClusterStatus.RUNNING.value)
                cursor.execute(STRANDED_MEMBERS_SQL, params)
                rows = cursor.fetchall()
            if not rows:
                continue  # claimed or settled meanwhile
            attempts, budget = rows[0][:2]
            members = [Member.lost(*row[2:]) for row in rows if row[2] is not None]
            states = [m.state for m in members]
            # Without members (deleted with their jobs) nothing can start again.
            verdict = decide(states, budget_left=budget_left(attempts, budget)) or Verdict.FAIL
            settle(None, cluster_id, verdict, members)
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
# outcome, failure kind, dead: its job final or gone, aborted: its job Aborted) and the
# attempt and cluster it belongs to, in job-key order. {attempt} is the attempt's id, or
# REPORTED_ATTEMPT.
MEMBERS_SQL = """
SELECT a.id, a.cluster_job_id, a.started_at IS NOT NULL, a.finished_at IS NOT NULL,
       c.attempts, c.retry_budget,
       d.id, d.job_id, d.worker_id, d.evaluation_id, d.derivation_build_id, d.finished_at,
       d.outcome, d.failure_kind,
       EXISTS (SELECT 1 FROM cluster_member m
               WHERE m.cluster_job_id = a.cluster_job_id AND m."primary"
                 AND (m.evaluation_id = d.evaluation_id
                      OR m.derivation_build_id = d.derivation_build_id)),
       coalesce(coalesce(e.status, b.status) = ANY(%(dead)s), true),
       coalesce(coalesce(e.status, b.status) = ANY(%(aborted)s), false)
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
# Reports of one attempt queue on its row (resolve_attempt locks it first too).
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
    aborted: bool

    @classmethod
    def lost(cls, job_id, evaluation_id, build_id, primary, dead, aborted) -> "Member":
        """A member whose row closed without a verdict: it counts as lost with its worker."""
        return cls(
            None,
            job_id,
            None,
            evaluation_id,
            build_id,
            timezone.now(),
            "Failed",
            LOST,
            primary,
            dead,
            aborted,
        )

    @property
    def state(self) -> MemberState:
        outcome = self.outcome if self.outcome in ("Completed", "Failed") else None
        return MemberState(
            self.job_id, self.primary, outcome, self.failure_kind, self.dead, self.aborted
        )


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
        return cls(attempt_id, cluster_id, started, closed, budget_left(attempts, budget), members)


def _send(sql: str, params):
    """Execute on a cursor of its own: in a pipeline, its result is read after the sync."""
    cursor = connection.cursor()
    cursor.execute(sql, params)
    return cursor


# The job statuses the members' SQL reads as dead (final) and as aborted.
DEAD_STATUSES = sorted(EVALUATION_TERMINAL | BUILD_TERMINAL)
ABORTED_STATUSES = sorted({EvaluationStatus.ABORTED, BuildStatus.ABORTED})


def _statuses(**params) -> dict:
    """`params` with the statuses the members' SQL reads."""
    return {"dead": DEAD_STATUSES, "aborted": ABORTED_STATUSES, **params}


# Where a settlement sends a member's job: (build status, evaluation status).
SETTLED_STATUS = {
    Settlement.COMPLETED: (BuildStatus.COMPLETED, EvaluationStatus.COMPLETED),
    Settlement.REQUEUED: (BuildStatus.QUEUED, EvaluationStatus.QUEUED),
    Settlement.FAILED: (BuildStatus.FAILED_PERMANENT, EvaluationStatus.FAILED),
    Settlement.ABORTED: (BuildStatus.ABORTED, EvaluationStatus.ABORTED),
}


def _job_moves(verdict: Verdict, members: list[Member]) -> dict[str, list[tuple]]:
    """(job, target, its sources) per member job, by kind, as verdict.member_moves says."""
    settlements = member_moves(verdict, [m.state for m in members])
    moves: dict[str, list[tuple]] = {"build": [], "eval": []}
    for m in members:
        settlement = settlements[m.job_id]
        to_build, to_eval = SETTLED_STATUS[settlement]
        if m.derivation_build_id:
            kind, job, to, sources = "build", m.derivation_build_id, to_build, BUILD_SOURCES
        elif m.evaluation_id:
            kind, job, to, sources = "eval", m.evaluation_id, to_eval, EVALUATION_SOURCES
        else:
            continue  # its job is gone
        # Requeued: only from where the attempt held it (never a job that ended meanwhile).
        allowed = (
            sources[to] & RELEASED_FROM[kind] if settlement == Settlement.REQUEUED else sources[to]
        )
        moves[kind].append((job, to, ",".join(sorted(allowed))))
    return moves


def settle(attempt_id, cluster_id, verdict: Verdict, members: list[Member]) -> list[int]:
    """Apply a decided verdict inside the caller's transaction, the attempt locked: close the
    attempt (abandoning open member rows), set the cluster, settle every member's job. Returns
    the workers of the survivors, to be told AbortCluster after commit. Without an attempt
    (None: a Running cluster that lost its own, the cluster locked), the cluster and the jobs."""
    survivors = sorted({m.worker_id for m in members if m.finished_at is None})
    now = timezone.now()
    if attempt_id is None:
        set_cluster_status(cluster_id, CLUSTER_STATUS[verdict], now)
    else:
        close_cluster_attempt(
            attempt_id, ATTEMPT_OUTCOME[verdict], now, cluster_status=CLUSTER_STATUS[verdict]
        )
    with connection.wrap_database_errors, connection.connection.pipeline():
        for kind, moves in _job_moves(verdict, members).items():
            if moves:
                _send(MOVE_SQL[kind], [list(column) for column in zip(*moves, strict=True)])
    log.info(
        "cluster %s decided %s (attempt %s)",
        cluster_id,
        verdict,
        attempt_id,
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
    }
    params = _statuses(**params)
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


def _resolve(attempt: Attempt, *, aborted: bool = False) -> tuple[Verdict | None, list[int]]:
    """The verdict of the reports so far, settled when there is one; the survivors."""
    states = [m.state for m in attempt.members]
    verdict = decide(states, budget_left=attempt.budget_left, aborted=aborted)
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
            member_report(worker_id, job_id, pk, "Failed", LOST)
    return len(rows)


def resolve_attempt(attempt_id, reason: str, *, aborted: bool = False) -> Verdict | None:
    """Ask the verdict about an open attempt without a report of its own: a member job ended
    outside the attempt (the sweep), or the whole cluster is aborted (`aborted`). Settles and
    tells the survivors when there is a verdict; None when there is none, or it was closed."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM cluster_attempt WHERE id = %s AND finished_at IS NULL FOR UPDATE",
                [attempt_id],
            )
            if cursor.fetchone() is None:
                return None
            cursor.execute(ATTEMPT_MEMBERS_SQL, _statuses(attempt=attempt_id))
            attempt = Attempt.from_rows(cursor.fetchall())
        verdict, survivors = _resolve(attempt, aborted=aborted)
    if verdict is not None:
        notify_abort(attempt_id, reason, survivors)
    return verdict


def abort_attempt(attempt_id, reason: str) -> bool:
    """An evaluation abort reached every member (the operator aborted the cluster): the
    verdict on the open attempt is Abort, survivors end Aborted and are told. False if it was
    already closed."""
    return resolve_attempt(attempt_id, reason, aborted=True) == Verdict.ABORT
