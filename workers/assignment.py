"""The single path: RequestJob -> the best job of that kind for this worker -> claim -> AssignJob.

Members of a Queued or Running cluster are never given out here: they start only through
their cluster (clusters.tracking). Nothing to give records an idle slot, the planner's view
of free capacity.
"""

from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone

from clusters.reservation import is_reserved
from clusters.tracking import active_member_sql
from gradient.jobs.claim import Assignment, ClaimGate, claim_assignment
from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from gradient.jobs.transitions import advance_build, advance_evaluation
from workers.models import IdleSlot, Worker
from workers.protocol import AssignJob, JobSpec

FULL_STEPS = ["fetch", "evaluate_flake", "evaluate_derivations"]
FETCH_STEPS = ["fetch"]
FOLLOW_UP_STEPS = ["evaluate_flake", "evaluate_derivations"]
BUILD_STEPS = ["build"]
CANDIDATES = 20  # claims lost to rivals fall through to the next candidate

# Jobs of one kind this worker may take, best first: prioritized, least to fetch (a job never
# scored counts as the most expensive), oldest. The {placeholders} are fixed SQL fragments.
CANDIDATES_SQL = """
SELECT j.id, j.status, {substitute} AS substitute
FROM {table} j
LEFT JOIN job_score s ON s.worker_id = %(worker)s AND s.job_id = '{prefix}' || j.id::text
WHERE j.status = ANY(%(statuses)s)
  AND j.architecture = ANY(%(architectures)s)
  AND j.required_features <@ %(features)s
  AND (%(all_projects)s OR j.project_id IN (
        SELECT project_id FROM worker_projects WHERE worker_id = %(worker)s))
  AND NOT EXISTS (SELECT 1 FROM dispatched_job d
                  WHERE d.job_id = '{prefix}' || j.id::text AND d.finished_at IS NULL)
  {member_filter}
ORDER BY j.prioritized DESC, s.missing_nar_size ASC NULLS LAST, j.created_at ASC
LIMIT %(limit)s
"""


@dataclass(frozen=True)
class Offerable:
    """How one worker can serve a RequestJob of one kind."""

    kind: str
    statuses: tuple[str, ...]
    steps_for: dict  # job status -> steps


def offerable(worker: Worker, kind: str) -> Offerable | None:
    if kind == JobKind.BUILD:
        if not worker.can_build:
            return None
        return Offerable(kind, (BuildStatus.QUEUED,), {BuildStatus.QUEUED: BUILD_STEPS})
    if worker.can_eval:
        # A fetched evaluation (status Fetching, its fetch-only job done) needs the follow-up.
        return Offerable(
            kind,
            (EvaluationStatus.QUEUED, EvaluationStatus.FETCHING),
            {EvaluationStatus.QUEUED: FULL_STEPS, EvaluationStatus.FETCHING: FOLLOW_UP_STEPS},
        )
    if worker.can_fetch:
        # A fetch-only worker takes the fetch step of a split single evaluation.
        return Offerable(kind, (EvaluationStatus.QUEUED,), {EvaluationStatus.QUEUED: FETCH_STEPS})
    return None


def candidates(worker: Worker, how: Offerable, *, members=False, limit=CANDIDATES) -> list:
    """(id, status, substitute) of the jobs this worker may take, best first. With `members`,
    cluster members are included (to be offered for scoring, never to be assigned here),
    except to a fetch-only worker: a member evaluation always runs as one job."""
    is_build = how.kind == JobKind.BUILD
    fetch_only = how.steps_for.get(EvaluationStatus.QUEUED) == FETCH_STEPS
    sql = CANDIDATES_SQL.format(
        table="derivation_build" if is_build else "evaluation",
        prefix="build:" if is_build else "eval:",
        substitute="j.cache_available" if is_build else "false",
        member_filter=""
        if members and not fetch_only
        else f"AND NOT EXISTS ({active_member_sql('j.id', how.kind)})",
    )
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            {
                "worker": worker.pk,
                "statuses": list(how.statuses),
                "architectures": worker.architectures,
                "features": worker.system_features,
                "all_projects": worker.all_projects,
                "limit": limit,
            },
        )
        return cursor.fetchall()


def open_count(worker_id: int, kind: str) -> int:
    """Assignments a worker holds of one kind; held cluster members count against its slots."""
    from gradient.jobs.models import DispatchedJob

    return DispatchedJob.objects.filter(
        worker_id=worker_id, kind=kind, finished_at__isnull=True
    ).count()


def is_full(worker: Worker, kind: str) -> bool:
    limit = worker.max_concurrent_builds if kind == JobKind.BUILD else worker.max_concurrent_evals
    return open_count(worker.pk, kind) >= limit


def _claim_one(worker: Worker, how: Offerable, job_id, status, substitute) -> Assignment | None:
    assignment = Assignment(
        gate=ClaimGate(how.kind, job_id, substitute),
        worker_id=worker.pk,
        project_id=0,  # set below from the job row inside the transaction
        steps=how.steps_for[status],
    )
    with transaction.atomic(durable=True):
        model = _model(how.kind)
        job = model.objects.filter(pk=job_id).values("project_id").first()
        if job is None:
            return None
        assignment.project_id = job["project_id"]
        if not claim_assignment(assignment):
            return None
        if not _assigned_transition(how.kind, job_id, status, assignment.steps):
            transaction.set_rollback(True)
            return None
        IdleSlot.objects.filter(worker=worker, kind=how.kind).delete()
    return assignment


def _model(kind):
    from gradient.jobs.models import DerivationBuild, Evaluation

    return DerivationBuild if kind == JobKind.BUILD else Evaluation


def _assigned_transition(kind, job_id, status, steps) -> bool:
    if kind == JobKind.BUILD:
        return advance_build(job_id, BuildStatus.BUILDING, {BuildStatus.QUEUED})
    to = EvaluationStatus.FETCHING if steps == FETCH_STEPS else EvaluationStatus.EVALUATING_FLAKE
    return advance_evaluation(job_id, to, {status})


def record_idle(worker_id: int, kind: str) -> None:
    IdleSlot.objects.update_or_create(
        worker_id=worker_id, kind=kind, defaults={"recorded_at": timezone.now()}
    )


def clear_idle(worker_id: int, kind: str | None = None) -> None:
    slots = IdleSlot.objects.filter(worker_id=worker_id)
    if kind is not None:
        slots = slots.filter(kind=kind)
    slots.delete()


def request_job(worker_id: int, kind: str) -> AssignJob | None:
    """Answer a RequestJob: an AssignJob for the best job this worker can take now, or None
    after recording an idle slot (none when the worker is full, draining or cannot serve)."""
    worker = Worker.objects.get(pk=worker_id)
    how = offerable(worker, kind)
    if how is None or worker.draining or is_full(worker, kind):
        clear_idle(worker_id, kind)
        return None
    if is_reserved(worker_id, kind):
        # A reserved seat: no new single job of this kind, and its idle slot is what lets
        # the reservation commit.
        record_idle(worker_id, kind)
        return None
    for job_id, status, substitute in candidates(worker, how):
        assignment = _claim_one(worker, how, job_id, status, substitute)
        if assignment is not None:
            return assign_frame(assignment)
    record_idle(worker_id, kind)
    return None


def assign_frame(assignment: Assignment, cluster=None) -> AssignJob:
    from gradient.jobs.models import Project

    gate = assignment.gate
    job = _model(gate.kind).objects.values("architecture", "required_features").get(pk=gate.job)
    project = Project.objects.values_list("name", flat=True).get(pk=assignment.project_id)
    is_eval = gate.kind == JobKind.EVAL
    return AssignJob(
        job_id=gate.key,
        assignment_id=str(assignment.id),
        job=JobSpec(
            kind=gate.kind,
            project=project,
            evaluation=str(gate.job) if is_eval else None,
            build=None if is_eval else str(gate.job),
            architecture=job["architecture"],
            required_features=job["required_features"],
            steps=assignment.steps,
        ),
        cluster=cluster,
    )
