"""The jobs app's raw SQL, each statement and shared fragment named once, under the path that
runs it; the code modules import them from here."""

from gradient.jobs.models import DISPATCHED_MACHINE

# --- The claims, single and member (gradient.jobs.claim) ---
# The claim's rows, an assignment each, aliased t, sent as one JSON document: cheaper than
# psycopg's dumping of a list element by element.
CLAIM_ROWS = """json_to_recordset(%(claims)s::json)
     AS t(id uuid, kind text, job_id text, evaluation_id uuid, build_id uuid, worker_id bigint,
          project_id bigint, steps text, dispatched_at timestamptz, attempt_id uuid,
          size bigint, substitute bool)"""
# The start condition of a row's job (ClaimGate), which a cluster claim also reads before it
# writes. OFFSET 0 keeps each probe a primary-key read rather than a hash of a whole table.
START_CONDITION = """CASE WHEN t.build_id IS NOT NULL
     THEN EXISTS (SELECT 1 FROM derivation_build b WHERE b.id = t.build_id
                  AND b.status = ANY(%(build_startable)s) AND b.cache_available = t.substitute
                  OFFSET 0)
     ELSE EXISTS (SELECT 1 FROM evaluation e WHERE e.id = t.evaluation_id
                  AND e.status = ANY(%(eval_startable)s) OFFSET 0)
END"""
# What a claimed row's job runs, for its AssignJob: read only here, so that the reads of the
# queue never carry it.
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


def claim_sql(also: str) -> str:
    """The claim of the rows that also meet `also` (SQL over the row t)."""
    return CLAIM_TEMPLATE.replace("/*also*/", f"AND {also}")


# --- Reports and disconnects: assignments finished (gradient.jobs.transitions) ---
FINISH_ASSIGNMENTS_SQL = DISPATCHED_MACHINE.update(
    "finish",
    "id = ANY(%(ids)s)",
    also=", failure_kind = %(failure_kind)s, error = %(error)s, log_tail = %(log_tail)s",
)
