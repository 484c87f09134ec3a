"""claim_assignment: the single-assignment claim statement.

One INSERT ... SELECT ... WHERE <start condition> ON CONFLICT DO NOTHING over a set of rows,
an assignment each: each job's start condition and idx-dispatched_job-open-job decide in
PostgreSQL whether its claimer wins, so any number of processes can claim at once and at most
one row per job key is ever open. A single job is one row; a cluster claim (clusters.claim)
sends every member's row, each with its own job key, start condition and attempt, to the same
statement.
"""

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from gradient.jobs.models import BUILD_STARTABLE, EVALUATION_STARTABLE, JobKind
from gradient.wire.keys import job_key


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
    # What its job runs, as the claim read it back (CLAIMED_WORK): set once claimed.
    work: dict | None = None


# The claim's rows, an assignment each (claim_rows), aliased t. They go as one JSON document:
# psycopg dumps a Python list element by element (a type lookup and a quoting check for
# each), which for a dispatch pass's batch of members cost more than the statement itself;
# json.dumps is C, and PostgreSQL reads the rows with json_to_recordset.
CLAIM_ROWS = """json_to_recordset(%(claims)s::json)
     AS t(id uuid, kind text, job_id text, evaluation_id uuid, build_id uuid, worker_id bigint,
          project_id bigint, steps text, dispatched_at timestamptz, attempt_id uuid,
          size bigint, substitute bool)"""

# The start condition of a row's job (ClaimGate). A cluster claim also reads it to leave out,
# before writing anything, an attempt with a member that cannot start. Each probe reads its
# row by primary key: OFFSET 0 keeps PostgreSQL from hashing a whole table instead, which it
# would for the hundred rows it guesses a JSON document holds.
START_CONDITION = """CASE WHEN t.build_id IS NOT NULL
     THEN EXISTS (SELECT 1 FROM derivation_build b WHERE b.id = t.build_id
                  AND b.status = ANY(%(build_startable)s) AND b.cache_available = t.substitute
                  OFFSET 0)
     ELSE EXISTS (SELECT 1 FROM evaluation e WHERE e.id = t.evaluation_id
                  AND e.status = ANY(%(eval_startable)s) OFFSET 0)
END"""
# What a claimed row's job runs (gradient.jobs.work), for its AssignJob: read here, for the
# jobs claimed alone, so that the reads of the queue never carry it. One JSON object with the
# AssignJob's own keys, read by its job's primary key, as START_CONDITION probes it.
CLAIMED_WORK = """CASE WHEN dispatched_job.derivation_build_id IS NOT NULL
     THEN (SELECT json_build_object('command', b.command, 'env', b.env,
                                    'timeout_secs', b.timeout_secs)
           FROM derivation_build b WHERE b.id = dispatched_job.derivation_build_id)
     ELSE (SELECT json_build_object('command', e.command, 'env', e.env,
                                    'timeout_secs', e.timeout_secs)
           FROM evaluation e WHERE e.id = dispatched_job.evaluation_id)
END"""

# Rows go in job-key order, so overlapping claimers queue on the same key first. Each row
# claimed comes back with its job's work. A caller adds its own condition (claim_sql): the
# single path which candidate it takes, a cluster claim that the row's attempt was opened.
CLAIM_TEMPLATE = f"""
INSERT INTO dispatched_job (
    id, kind, job_id, evaluation_id, derivation_build_id, worker_id, project_id, steps,
    dispatched_at, cluster_attempt_id, missing_nar_size
)
SELECT t.id, t.kind, t.job_id, t.evaluation_id, t.build_id, t.worker_id, t.project_id,
       string_to_array(t.steps, ','), t.dispatched_at, t.attempt_id, t.size
FROM {CLAIM_ROWS}
WHERE {START_CONDITION}
  /*also*/
ORDER BY t.job_id
ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING job_id, {CLAIMED_WORK} AS work
"""
CLAIM_SQL = CLAIM_TEMPLATE.replace("/*also*/", "")


def claim_sql(also: str) -> str:
    """CLAIM_SQL for the rows that also meet `also` (SQL over the row t)."""
    return CLAIM_TEMPLATE.replace("/*also*/", f"AND {also}")


START_PARAMS = {
    "build_startable": sorted(BUILD_STARTABLE),
    "eval_startable": sorted(EVALUATION_STARTABLE),
}


def claim_params(assignments: list[Assignment]) -> dict:
    """The parameters of CLAIM_SQL (and of START_CONDITION over CLAIM_ROWS)."""
    now = timezone.now().isoformat()
    rows = []
    for a in assignments:
        is_build = a.gate.kind == JobKind.BUILD
        job = str(a.gate.job)
        rows.append(
            {
                "id": a.id.hex,
                "kind": a.gate.kind,
                "job_id": a.gate.key,
                "evaluation_id": None if is_build else job,
                "build_id": job if is_build else None,
                "worker_id": a.worker_id,
                "project_id": a.project_id,
                "steps": ",".join(a.steps),
                "dispatched_at": a.dispatched_at.isoformat() if a.dispatched_at else now,
                "attempt_id": a.cluster_attempt_id.hex if a.cluster_attempt_id else None,
                "size": a.missing_nar_size,
                "substitute": a.gate.substitute,
            }
        )
    return {"claims": json.dumps(rows), **START_PARAMS}


def claim_assignment(assignment: Assignment, using=None) -> bool:
    """Insert the assignment's open row if its job can start and has no open row.

    True when this call won. Runs in the caller's transaction when there is one.
    """
    with connections[using or DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(CLAIM_SQL, claim_params([assignment]))
        return cursor.fetchone() is not None
