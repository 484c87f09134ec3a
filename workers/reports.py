"""JobCompleted and JobFailed: finish the assignment row, then move the job.

A single job moves through its state machine at once: success completes it, a requeueing
failure puts it back in the queue until its attempts run out, anything else ends it. A cluster
member's report only finishes its row: its job's transition waits for the attempt's verdict.
"""

import uuid

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from clusters.coordinator import member_accepted, member_rejected
from clusters.recovery import member_report
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchedOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.transitions import advance_build, advance_evaluation
from workers.assignment import FETCH_STEPS

# Failure kinds after which the same job may succeed on another try.
REQUEUEING_FAILURES = frozenset(
    {"transient", "timeout", "substitute_unavailable", "inputs_unavailable", "corrupt_eval_cache"}
)
ABORTING_FAILURES = frozenset({"aborted", "canceled"})


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


def _finish(row: DispatchedJob, outcome: str) -> None:
    row.finished_at = timezone.now()
    row.outcome = outcome
    row.save(update_fields=["finished_at", "outcome"])


def _is_member(assignment_id: str) -> bool:
    try:
        pk = uuid.UUID(assignment_id)
    except ValueError:
        return False
    return DispatchedJob.objects.filter(pk=pk, cluster_attempt__isnull=False).exists()


def job_completed(worker_id: int, job_id: str, assignment_id: str) -> None:
    if _is_member(assignment_id):
        member_report(worker_id, job_id, assignment_id, DispatchedOutcome.COMPLETED)
        return
    with transaction.atomic(durable=True):
        row = _open_row(worker_id, job_id, assignment_id)
        _finish(row, DispatchedOutcome.COMPLETED)
        _complete_single(row)


def job_failed(worker_id: int, job_id: str, assignment_id: str, kind: str) -> None:
    if _is_member(assignment_id):
        member_report(worker_id, job_id, assignment_id, DispatchedOutcome.FAILED, kind)
        return
    with transaction.atomic(durable=True):
        row = _open_row(worker_id, job_id, assignment_id)
        _finish(row, DispatchedOutcome.FAILED)
        row.failure_kind = kind
        row.save(update_fields=["failure_kind"])
        _fail_single(row, kind)


def _complete_single(row: DispatchedJob) -> None:
    if row.kind == JobKind.BUILD:
        advance_build(row.derivation_build_id, BuildStatus.COMPLETED)
    elif row.steps != FETCH_STEPS:
        advance_evaluation(row.evaluation_id, EvaluationStatus.COMPLETED)
    # A fetch-only job leaves its evaluation Fetching: the follow-up job evaluates it.


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
    """Abandoned single assignments (a disconnect, a silent worker): their jobs go back to the
    queue. A failed prepare and a retry release cluster members through clusters.claim."""
    for row in rows:
        if row.kind == JobKind.BUILD:
            advance_build(row.derivation_build_id, BuildStatus.QUEUED, {BuildStatus.BUILDING})
        else:
            advance_evaluation(row.evaluation_id, EvaluationStatus.QUEUED)


def job_accepted(worker_id: int, job_id: str) -> None:
    """A single job needs nothing more; a member's acceptance may start its attempt."""
    if DispatchedJob.objects.filter(
        worker_id=worker_id, job_id=job_id, finished_at__isnull=True, cluster_attempt__isnull=False
    ).exists():
        member_accepted(worker_id, job_id)
    elif not DispatchedJob.objects.filter(
        worker_id=worker_id, job_id=job_id, finished_at__isnull=True
    ).exists():
        raise NotAllowed(f"{job_id} was not assigned to this worker")


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
