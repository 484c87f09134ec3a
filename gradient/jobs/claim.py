"""claim_assignment: the single-assignment claim statement.

One INSERT ... SELECT ... WHERE <start condition> ON CONFLICT DO NOTHING: the job's start
condition and idx-dispatched_job-open-job decide in PostgreSQL whether this claimer wins, so
any number of processes can claim at once and at most one row per job key is ever open.
"""

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from gradient.jobs.models import EVALUATION_STARTABLE, BuildStatus, JobKind

EVAL_PREFIX = "eval:"
BUILD_PREFIX = "build:"


def job_key(kind: str, job_uuid) -> str:
    return f"{EVAL_PREFIX if kind == JobKind.EVAL else BUILD_PREFIX}{job_uuid}"


@dataclass(frozen=True)
class ClaimGate:
    """The start condition of one job. A build must still be Queued in the substitute mode the
    claimer saw; an evaluation must not be finished."""

    kind: str
    job: uuid.UUID
    substitute: bool = False

    @cached_property
    def key(self) -> str:
        # Cached: a batch of claims sorts and matches its members by key several times over.
        return job_key(self.kind, self.job)

    def condition(self) -> tuple[str, list]:
        if self.kind == JobKind.BUILD:
            return (
                "EXISTS (SELECT 1 FROM derivation_build WHERE id = %s AND status = %s"
                " AND cache_available = %s)",
                [self.job, BuildStatus.QUEUED.value, self.substitute],
            )
        return (
            "EXISTS (SELECT 1 FROM evaluation WHERE id = %s AND status = ANY(%s))",
            [self.job, sorted(s.value for s in EVALUATION_STARTABLE)],
        )


@dataclass
class Assignment:
    gate: ClaimGate
    worker_id: int
    project_id: int
    steps: list[str] = field(default_factory=list)
    cluster_attempt_id: uuid.UUID | None = None
    missing_nar_size: int | None = None
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    dispatched_at: datetime | None = None


CLAIM_SQL = """
INSERT INTO dispatched_job (
    id, kind, job_id, evaluation_id, derivation_build_id, worker_id, project_id, steps,
    dispatched_at, cluster_attempt_id, missing_nar_size
)
SELECT %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s
WHERE {condition}
ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING id
"""


def claim_statement(assignment: Assignment) -> tuple[str, list]:
    """The claim statement of one assignment, with its own job key and start condition."""
    gate = assignment.gate
    condition, cond_params = gate.condition()
    is_eval = gate.kind == JobKind.EVAL
    params = [
        assignment.id,
        gate.kind,
        gate.key,
        gate.job if is_eval else None,
        None if is_eval else gate.job,
        assignment.worker_id,
        assignment.project_id,
        assignment.steps,
        assignment.dispatched_at or timezone.now(),
        assignment.cluster_attempt_id,
        assignment.missing_nar_size,
        *cond_params,
    ]
    return CLAIM_SQL.format(condition=condition), params


def claim_assignment(assignment: Assignment, using=None) -> bool:
    """Insert the assignment's open row if its job can start and has no open row.

    True when this call won. Runs in the caller's transaction when there is one, so a cluster
    claim can chain several of these and roll all back on the first loss.
    """
    conn = connections[using or DEFAULT_DB_ALIAS]
    with conn.cursor() as cursor:
        cursor.execute(*claim_statement(assignment))
        return cursor.fetchone() is not None


def claim_assignments(assignments: list[Assignment], using=None) -> bool:
    """claim_assignment for each assignment in turn, all sent in one round trip (a psycopg
    pipeline); True when every one won.

    Every statement runs, in the given order, even after one lost: the caller must run this
    in a transaction and roll it back on False. An error (a lock_timeout) aborts the rest of
    the pipeline and is raised as Django's DatabaseError.
    """
    conn = connections[using or DEFAULT_DB_ALIAS]
    conn.ensure_connection()
    pg = conn.connection
    cursors = [pg.cursor() for _ in assignments]
    with conn.wrap_database_errors:
        with pg.pipeline():
            for cursor, assignment in zip(cursors, assignments, strict=True):
                cursor.execute(*claim_statement(assignment))
        return all(cursor.fetchone() is not None for cursor in cursors)
