"""JobCompleted and JobFailed: finish the assignment row (with the report's error and log tail),
then move the job. A cluster member's job waits for the attempt's verdict instead.
"""

import uuid

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from clusters.coordinator import accept_assignment, member_rejected
from clusters.settlement import member_report
from clusters.verdict import ABORTING_FAILURES, REQUEUEING_FAILURES
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BUILD_MACHINE,
    DISPATCHED_MACHINE,
    EVALUATION_MACHINE,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchedOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.steps import FETCH_STEPS
from gradient.jobs.transitions import advance_build, advance_evaluation, finish_assignments
from gradient.jobs.work import kept_error, kept_log_tail
from sessions import statements


def _open_row(worker_id: int, job_id: str, assignment_id: str) -> DispatchedJob:
    try:
        pk = uuid.UUID(assignment_id)
    except ValueError:
        raise NotAllowed(f"no assignment {assignment_id!r}") from None
    row = (
        DispatchedJob.objects.select_for_update()
        .filter(pk=pk, worker_id=worker_id, job_id=job_id, finished_at__isnull=True)
        .first()
    )
    if row is None:
        raise NotAllowed(f"{job_id} is not held by this worker under {assignment_id}")
    return row


def _finish(
    row: DispatchedJob, outcome: str, failure_kind: str | None = None, **report: str | None
) -> None:
    # The row is locked and open (_open_row): its guarded write cannot miss.
    row.finished_at = timezone.now()
    row.outcome, row.failure_kind = outcome, failure_kind
    finish_assignments([row.pk], outcome, row.finished_at, failure_kind, **report)


def _assignment_pk(assignment_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(assignment_id)
    except ValueError:
        raise NotAllowed(f"no assignment {assignment_id!r}") from None


COMPLETE_PARAMS = {
    **BUILD_MACHINE.bind("build", BuildStatus.COMPLETED),
    **EVALUATION_MACHINE.bind("eval", EvaluationStatus.COMPLETED),
}


def job_completed(
    worker_id: int, job_id: str, assignment_id: str, log_tail: str | None = None
) -> None:
    pk = _assignment_pk(assignment_id)
    log_tail = kept_log_tail(log_tail)
    params = {
        "id": pk,
        "worker": worker_id,
        "job": job_id,
        "log_tail": log_tail,
        "fetch_only": FETCH_STEPS,
        **COMPLETE_PARAMS,
        **DISPATCHED_MACHINE.bind("done", DispatchedOutcome.COMPLETED, at=timezone.now()),
    }
    with connection.cursor() as cursor:
        cursor.execute(statements.COMPLETE_SINGLE_SQL, params)
        finished, is_member = cursor.fetchone()
    if finished:
        return
    if is_member:
        member_report(worker_id, job_id, pk, DispatchedOutcome.COMPLETED, log_tail=log_tail)
        return
    raise NotAllowed(f"{job_id} is not held by this worker under {assignment_id}")


def job_failed(
    worker_id: int,
    job_id: str,
    assignment_id: str,
    kind: str,
    error: str | None = None,
    log_tail: str | None = None,
) -> None:
    """The member path goes first; a single's failure then runs in the transaction it opened, so
    telling them apart costs no query of its own."""
    pk = _assignment_pk(assignment_id)
    report = {"error": kept_error(error), "log_tail": kept_log_tail(log_tail)}

    def single() -> None:
        row = _open_row(worker_id, job_id, assignment_id)
        _finish(row, DispatchedOutcome.FAILED, kind, **report)
        _fail_single(row, kind)

    member_report(worker_id, job_id, pk, DispatchedOutcome.FAILED, kind, **report, single=single)


def attempts_left(row: DispatchedJob) -> bool:
    failed = DispatchedJob.objects.filter(
        job_id=row.job_id, outcome=DispatchedOutcome.FAILED
    ).count()
    return failed < settings.GRADIENT["MAX_JOB_ATTEMPTS"]


def _fail_single(row: DispatchedJob, kind: str) -> None:
    requeue = kind in REQUEUEING_FAILURES and attempts_left(row)
    if row.kind == JobKind.BUILD:
        if kind == "substitute_unavailable":
            # The cache lost the output: build it from source next time.
            DerivationBuild.objects.filter(pk=row.derivation_build_id).update(cache_available=False)
        if requeue:
            advance_build(row.derivation_build_id, BuildStatus.QUEUED, {BuildStatus.BUILDING})
        elif kind in ABORTING_FAILURES:
            advance_build(row.derivation_build_id, BuildStatus.ABORTED)
        else:
            advance_build(row.derivation_build_id, BuildStatus.FAILED_PERMANENT)
    elif requeue:
        advance_evaluation(row.evaluation_id, EvaluationStatus.QUEUED)
    elif kind in ABORTING_FAILURES:
        advance_evaluation(row.evaluation_id, EvaluationStatus.ABORTED)
    else:
        advance_evaluation(row.evaluation_id, EvaluationStatus.FAILED)


def release_single(rows) -> None:
    """Abandoned single assignments (a disconnect, a silent worker): their jobs are requeued."""
    for row in rows:
        if row.kind == JobKind.BUILD:
            advance_build(row.derivation_build_id, BuildStatus.QUEUED, {BuildStatus.BUILDING})
        else:
            advance_evaluation(row.evaluation_id, EvaluationStatus.QUEUED)


def job_accepted(worker_id: int, job_id: str) -> None:
    """A single job needs nothing more; a member's acceptance may start its attempt."""
    accept_assignment(worker_id, job_id)


def job_rejected(worker_id: int, job_id: str, reason: str | None = None) -> None:
    """A worker refused an AssignJob: the single assignment ends Abandoned and its job goes
    back to the queue. A member's refusal is its attempt's failed prepare."""
    if DispatchedJob.objects.filter(
        worker_id=worker_id, job_id=job_id, finished_at__isnull=True, cluster_attempt__isnull=False
    ).exists():
        member_rejected(worker_id, job_id, reason)
        return
    with transaction.atomic(durable=True):
        row = (
            DispatchedJob.objects.select_for_update()
            .filter(worker_id=worker_id, job_id=job_id, finished_at__isnull=True)
            .first()
        )
        if row is None:
            raise NotAllowed(f"{job_id} was not assigned to this worker")
        _finish(row, DispatchedOutcome.ABANDONED)
        release_single([row])
