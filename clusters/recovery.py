"""Recovery sweeps: bring every cluster back to a consistent state from the database alone.

Safe to run at start-up and at any time, from any number of processes at once: each step is
one of the claim module's transactions, which re-check what they change. Deadlines are
computed from stored times (an attempt's created_at), so a restart never resets one.
"""

import contextlib
import logging
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from clusters.claim import (
    bound_lock_waits,
    can_retry,
    close_attempt_rows,
    dead_member_count,
    release_members,
    set_cluster_status,
)
from clusters.coordinator import abort_prepare, notify_abort
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterMember, ClusterStatus
from clusters.verdict import MemberState, Verdict, decide
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BUILD_TERMINAL,
    EVALUATION_TERMINAL,
    BuildStatus,
    DispatchedJob,
    EvaluationStatus,
)
from gradient.jobs.transitions import advance_build, advance_evaluation
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


def member_states(attempt_id) -> tuple[list[MemberState], list[DispatchedJob]]:
    rows = list(
        DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).select_related(
            "evaluation", "derivation_build"
        )
    )
    primaries = set(
        ClusterMember.objects.filter(
            cluster_job__attempts_made=attempt_id, primary=True
        ).values_list("evaluation_id", "derivation_build_id")
    )
    primary_jobs = {j for pair in primaries for j in pair if j}
    states = []
    for row in rows:
        job = row.evaluation or row.derivation_build
        dead = job is None or job.status in (EVALUATION_TERMINAL | BUILD_TERMINAL)
        outcome = {"Completed": "Completed", "Failed": "Failed"}.get(row.outcome)
        states.append(
            MemberState(
                key=row.job_id,
                primary=(row.evaluation_id or row.derivation_build_id) in primary_jobs,
                outcome=outcome,
                failure_kind=row.failure_kind,
                dead=dead,
            )
        )
    return states, rows


def _settle_jobs(verdict: Verdict, attempt_id, rows: list[DispatchedJob]) -> None:
    if verdict == Verdict.RETRY:
        release_members(attempt_id)
        return
    for row in rows:
        if row.outcome == "Completed":
            to_build, to_eval = BuildStatus.COMPLETED, EvaluationStatus.COMPLETED
        elif row.outcome == "Failed" and row.failure_kind not in ("aborted", "canceled"):
            # Settled for good: a requeueing kind becomes permanent.
            to_build, to_eval = BuildStatus.FAILED_PERMANENT, EvaluationStatus.FAILED
        else:  # a survivor, still running when the attempt was decided
            to_build, to_eval = BuildStatus.ABORTED, EvaluationStatus.ABORTED
        if row.derivation_build_id:
            advance_build(row.derivation_build_id, to_build)
        elif row.evaluation_id:
            advance_evaluation(row.evaluation_id, to_eval)


def settle(attempt: ClusterAttempt, verdict: Verdict, rows: list[DispatchedJob]) -> list[int]:
    """Apply a decided verdict inside the caller's transaction: close the attempt (abandoning
    open member rows), set the cluster, settle every member's job. Returns the workers of the
    survivors, to be told AbortCluster after commit."""
    survivors = sorted({r.worker_id for r in rows if r.finished_at is None})
    now = timezone.now()
    close_attempt_rows(attempt.pk, ATTEMPT_OUTCOME[verdict], now)
    for row in rows:
        if row.finished_at is None:
            row.finished_at, row.outcome = now, "Abandoned"
    set_cluster_status(attempt.cluster_job_id, CLUSTER_STATUS[verdict], now)
    _settle_jobs(verdict, attempt.pk, rows)
    log.info(
        "attempt %s decided %s",
        attempt.pk,
        verdict,
        extra=ids(cluster=attempt.cluster_job_id, attempt=attempt.pk),
    )
    return survivors


def member_report(
    worker_id: int, job_id: str, assignment_id, outcome: str, kind: str | None = None
) -> Verdict | None:
    """A member's JobCompleted/JobFailed (or its loss, outcome Failed with kind "lost").

    Releases its job without moving it; the first deciding report resolves the attempt and
    settles every member. Before the start, a failure is a failed prepare and never reaches
    the job. A report for a member the verdict already settled is accepted and changes
    nothing."""
    row = DispatchedJob.objects.filter(
        pk=assignment_id, worker_id=worker_id, job_id=job_id, cluster_attempt__isnull=False
    ).first()
    if row is None:
        raise NotAllowed(f"{job_id} is not a member held by this worker under {assignment_id}")
    verdict, survivors, prepare_failed = None, [], False
    with transaction.atomic(durable=True):
        bound_lock_waits()
        # Reports of one attempt queue here: each sees every report before it.
        attempt = ClusterAttempt.objects.select_for_update().get(pk=row.cluster_attempt_id)
        row = DispatchedJob.objects.select_for_update().get(pk=row.pk)
        if row.finished_at is not None:
            if attempt.finished_at is not None and row.outcome == "Abandoned":
                return None  # settled by the decided verdict
            raise NotAllowed(f"{job_id} was reported already")
        if attempt.started_at is None and outcome == "Completed":
            raise NotAllowed(f"{job_id} must not run before StartCluster")
        row.finished_at, row.outcome, row.failure_kind = timezone.now(), outcome, kind
        row.save(update_fields=["finished_at", "outcome", "failure_kind"])
        if attempt.started_at is None:
            prepare_failed = True
        else:
            states, rows = member_states(attempt.pk)
            cluster = ClusterJob.objects.get(pk=attempt.cluster_job_id)
            verdict = decide(states, budget_left=cluster.attempts - 1 < cluster.retry_budget)
            if verdict is not None:
                survivors = settle(attempt, verdict, rows)
    if prepare_failed:
        abort_prepare(attempt.pk, f"member {job_id} failed before the start ({kind})")
    elif survivors:
        notify_abort(attempt.pk, f"attempt decided: {verdict}", survivors)
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
        _, rows = member_states(attempt.pk)
        survivors = settle(attempt, Verdict.ABORT, rows)
    notify_abort(attempt_id, reason, survivors)
    return True
