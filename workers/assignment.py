"""The single path: RequestJob -> the cheapest job of the worker's head -> claim -> AssignJob.

Members of a Queued or Running cluster are never given out here: they start only through
their cluster (clusters.tracking). Nothing to give records an idle slot, the planner's view
of free capacity.
"""

import uuid
from typing import NamedTuple

from django.db import connection, transaction
from django.utils import timezone

from gradient.jobs.claim import Assignment, ClaimGate, claim_assignment
from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from gradient.jobs.transitions import advance_build, advance_evaluation
from workers.head import (
    FETCH_STEPS,
    Offerable,
    job_table,
    literals,
    offerable,
    platform_params,
    singles_sql,
)
from workers.models import IdleSlot, Worker
from workers.protocol import AssignJob, JobSpec

CANDIDATES = 20  # claims lost to rivals fall through to the next candidate

# The single jobs of the worker's head, cheapest first: prioritized, then one passed over by
# a window of younger jobs while first in line, then least to fetch (a job never scored is the
# most expensive), then oldest. `first` is the head's first in line, whose wait a claim of any
# other job lengthens. With each, what its claim and its AssignJob need.
CANDIDATES_SQL = """
WITH head AS ({singles})
SELECT h.id, h.status, h.substitute, h.project_id, h.project, h.architecture,
       h.required_features, h.paths,
       first_value(h.id) OVER (ORDER BY h.prioritized DESC, h.created_at ASC) AS first
FROM head h
LEFT JOIN job_score s ON s.worker_id = %(worker)s AND s.job_id = '{prefix}' || h.id::text
ORDER BY h.prioritized DESC, h.passed_over >= %(window)s DESC,
         s.missing_nar_size ASC NULLS LAST, h.created_at ASC
LIMIT %(limit)s
"""

PASSED_OVER_SQL = """
UPDATE {table} SET passed_over = passed_over + 1
WHERE id = %(first)s AND status IN ({statuses}) AND passed_over < 32767
"""


class Candidate(NamedTuple):
    """A row of CANDIDATES_SQL."""

    id: uuid.UUID
    status: str
    substitute: bool
    project_id: int
    project: str
    architecture: str
    required_features: list[str]
    paths: list[str]
    first: uuid.UUID


def candidates(worker: Worker, how: Offerable, *, limit=CANDIDATES) -> list[Candidate]:
    """The single jobs of this worker's head, best first."""
    _, prefix = job_table(how.kind)
    sql = CANDIDATES_SQL.format(singles=singles_sql(how), prefix=prefix)
    with connection.cursor() as cursor:
        cursor.execute(sql, {**platform_params(worker), "limit": limit})
        return [Candidate._make(row) for row in cursor.fetchall()]


def pass_over(how: Offerable, job: Candidate) -> None:
    """A job was given out ahead of the head's first in line: count it against that one."""
    if job.first == job.id:
        return
    table, _ = job_table(how.kind)
    with connection.cursor() as cursor:
        cursor.execute(
            PASSED_OVER_SQL.format(table=table, statuses=literals(how.statuses)),
            {"first": job.first},
        )


def _claim_one(worker: Worker, how: Offerable, job: Candidate) -> Assignment | None:
    assignment = Assignment(
        gate=ClaimGate(how.kind, job.id, job.substitute),
        worker_id=worker.pk,
        project_id=job.project_id,
        steps=how.steps_for[job.status],
    )
    with transaction.atomic(durable=True):
        if not claim_assignment(assignment):
            return None
        if not _assigned_transition(how.kind, job.id, job.status, assignment.steps):
            transaction.set_rollback(True)
            return None
        IdleSlot.objects.filter(worker=worker, kind=how.kind).delete()
    return assignment


def _assigned_transition(kind, job_id, status, steps) -> bool:
    if kind == JobKind.BUILD:
        return advance_build(job_id, BuildStatus.BUILDING, {BuildStatus.QUEUED})
    to = EvaluationStatus.FETCHING if steps == FETCH_STEPS else EvaluationStatus.EVALUATING_FLAKE
    return advance_evaluation(job_id, to, {status})


# One statement, outside any transaction: update_or_create would take four round trips
# (BEGIN, SELECT ... FOR UPDATE, the write, COMMIT) on every unanswered RequestJob. The slot is
# recorded only while the worker still has room for the kind: a cluster claim that seated it
# since the RequestJob counted its assignments (the offer and the candidates come between)
# has taken the slot, and recording it again would seat the worker twice, a prepare lost.
RECORD_IDLE_SQL = """
INSERT INTO idle_slot (worker_id, kind, recorded_at)
SELECT w.id, %(kind)s::text, %(now)s FROM worker w
WHERE w.id = %(worker)s
  AND (SELECT count(*) FROM dispatched_job d
       WHERE d.worker_id = w.id AND d.kind = %(kind)s::text AND d.finished_at IS NULL)
      < CASE WHEN %(kind)s::text = 'build' THEN w.max_concurrent_builds
             ELSE w.max_concurrent_evals END
ON CONFLICT (worker_id, kind) DO UPDATE SET recorded_at = EXCLUDED.recorded_at
"""


def record_idle(worker_id: int, kind: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(RECORD_IDLE_SQL, {"worker": worker_id, "kind": kind, "now": timezone.now()})


def clear_idle(worker_id: int, kind: str | None = None) -> None:
    slots = IdleSlot.objects.filter(worker_id=worker_id)
    if kind is not None:
        slots = slots.filter(kind=kind)
    slots.delete()


# The worker with what a RequestJob of one kind asks of its state: its open assignments of the
# kind (held cluster members count against its slots) and whether that slot is a seat of the
# active aging reservation (clusters.reservation): then it gets no single job of the kind.
# Written out: as an ORM query, compiling it cost daphne more than PostgreSQL spent running it.
LOAD_WORKER_SQL = """
SELECT {columns},
       (SELECT count(*) FROM dispatched_job d
        WHERE d.worker_id = w.id AND d.kind = %(kind)s::text AND d.finished_at IS NULL),
       EXISTS (SELECT 1 FROM reservation_seat s
               JOIN cluster_reservation r ON r.id = s.reservation_id
               WHERE s.worker_id = w.id AND s.kind = %(kind)s AND r.released_at IS NULL)
FROM worker w WHERE w.id = %(worker)s
"""
WORKER_FIELDS = [f.attname for f in Worker._meta.concrete_fields]


def load_worker(worker_id: int, kind: str) -> Worker:
    """The worker's row, with `open_count` and `reserved` for a RequestJob of this kind."""
    sql = LOAD_WORKER_SQL.format(columns=", ".join(f"w.{name}" for name in WORKER_FIELDS))
    with connection.cursor() as cursor:
        cursor.execute(sql, {"worker": worker_id, "kind": kind})
        row = cursor.fetchone()
    if row is None:
        raise Worker.DoesNotExist(worker_id)
    worker = Worker.from_db(connection.alias, WORKER_FIELDS, row[:-2])
    worker.open_count, worker.reserved = row[-2:]
    return worker


def request_job(worker_id: int, kind: str, worker: Worker | None = None) -> AssignJob | None:
    """Answer a RequestJob: an AssignJob for the best job this worker can take now, or None
    after recording an idle slot (none when the worker is full, draining or cannot serve).
    `worker`, when given, comes from load_worker(worker_id, kind)."""
    worker = worker or load_worker(worker_id, kind)
    how = offerable(worker, kind)
    limit = worker.max_concurrent_builds if kind == JobKind.BUILD else worker.max_concurrent_evals
    if how is None or worker.draining or worker.open_count >= limit:
        clear_idle(worker_id, kind)
        return None
    if worker.reserved:
        # A reserved seat: no new single job of this kind, and its idle slot is what lets
        # the reservation commit.
        record_idle(worker_id, kind)
        return None
    for job in candidates(worker, how):
        assignment = _claim_one(worker, how, job)
        if assignment is not None:
            pass_over(how, job)
            return assign_frame(assignment, job)
    record_idle(worker_id, kind)
    return None


def assign_frame(assignment: Assignment, job: Candidate) -> AssignJob:
    gate = assignment.gate
    is_eval = gate.kind == JobKind.EVAL
    return AssignJob(
        job_id=gate.key,
        assignment_id=str(assignment.id),
        job=JobSpec(
            kind=gate.kind,
            project=job.project,
            evaluation=str(gate.job) if is_eval else None,
            build=None if is_eval else str(gate.job),
            architecture=job.architecture,
            required_features=job.required_features,
            steps=assignment.steps,
        ),
    )
