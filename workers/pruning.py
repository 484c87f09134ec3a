"""Pruning job_score: a worker's rows (its answers to the offers) serve the offers and the
placements only while their job can still start. Nothing else removes them while the worker
stays connected, so without this pass every job ever scored kept one row per worker that
could take it. It runs on Celery beat every minute (settings.CELERY_BEAT_SCHEDULE) and
deletes the rows of jobs that finished or were deleted, and of keys that name no job (a worker
may answer for any key; its answer is stored all the same).

The rows of a job whose status is not final stay: a requeued build or a retried cluster
member would otherwise be offered to every worker again. Each batch of keys is its own
statement, so a backlog never holds long locks.
"""

from django.db import connection

from gradient.jobs.models import BUILD_TERMINAL, EVALUATION_TERMINAL

BATCH = 500  # job keys per DELETE

UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

# The keys scored whose job cannot start any more, after `after` in key order. The
# CASE guards the casts: PostgreSQL may test a join condition before a WHERE clause.
DONE_KEYS_SQL = """
SELECT k.job_id FROM (SELECT DISTINCT job_id FROM job_score WHERE job_id > %(after)s) k
WHERE NOT EXISTS (
        SELECT 1 FROM evaluation e
        WHERE e.id = CASE WHEN k.job_id ~ %(eval_key)s THEN substr(k.job_id, 6)::uuid END
          AND e.status <> ALL(%(eval_done)s))
  AND NOT EXISTS (
        SELECT 1 FROM derivation_build b
        WHERE b.id = CASE WHEN k.job_id ~ %(build_key)s THEN substr(k.job_id, 7)::uuid END
          AND b.status <> ALL(%(build_done)s))
ORDER BY k.job_id
LIMIT %(batch)s
"""


def prune_scores(batch: int = BATCH) -> int:
    """Delete the job_score rows of jobs that can no longer start; how many it deleted."""
    params = {
        "after": "",
        "eval_key": f"^eval:{UUID}$",
        "build_key": f"^build:{UUID}$",
        "eval_done": sorted(EVALUATION_TERMINAL),
        "build_done": sorted(BUILD_TERMINAL),
        "batch": batch,
    }
    deleted = 0
    with connection.cursor() as cursor:
        while True:
            cursor.execute(DONE_KEYS_SQL, params)
            keys = [row[0] for row in cursor.fetchall()]
            if not keys:
                return deleted
            cursor.execute("DELETE FROM job_score WHERE job_id = ANY(%s)", [keys])
            deleted += cursor.rowcount
            if len(keys) < batch:
                return deleted
            params["after"] = keys[-1]
