"""The session's raw SQL, each statement named once, under the path that runs it; the code
modules import them from here."""

from gradient.jobs.models import BUILD_MACHINE, DISPATCHED_MACHINE, EVALUATION_MACHINE

# --- A session's start and liveness (sessions.connection) ---
# The worker owning a token, by the token's hash, unless revoked.
AUTHENTICATE_SQL = "SELECT id, name FROM worker WHERE token_hash = %s AND revoked_at IS NULL"
# A session start in one statement, when no earlier session holds an open assignment: the
# worker's row locked, its offers (per connection) and the replaced session's idle slots
# forgotten, this session recorded as live. Else no row comes back and attach() goes the long way.
QUIET_ATTACH_SQL = """
WITH target AS (
    SELECT id, channel_name FROM worker WHERE id = %(worker)s FOR UPDATE
), quiet AS (
    SELECT t.id, t.channel_name FROM target t
    WHERE t.channel_name IS NULL OR NOT EXISTS (
        SELECT 1 FROM dispatched_job d WHERE d.worker_id = t.id AND d.finished_at IS NULL)
), slots AS (
    DELETE FROM idle_slot s USING quiet q
    WHERE s.worker_id = q.id AND q.channel_name IS NOT NULL
), offers AS (
    DELETE FROM job_score s USING quiet q WHERE s.worker_id = q.id
)
UPDATE worker w
SET channel_name = %(channel)s, connected_at = %(now)s, last_seen_at = %(now)s, draining = false
FROM quiet q WHERE w.id = q.id
RETURNING q.channel_name
"""
# Liveness in one statement: last_seen_at written, and whether this session is still the
# worker's live one with its token good.
TOUCH_SQL = """
WITH live AS (
    SELECT id FROM worker
    WHERE id = %(worker)s AND channel_name = %(channel)s AND revoked_at IS NULL
), seen AS (
    UPDATE worker SET last_seen_at = %(now)s WHERE id IN (SELECT id FROM live)
)
SELECT EXISTS (SELECT 1 FROM live)
"""
# WorkerCapabilities in one statement; the row comes back whole, for InitAck's name and the
# offer that follows (a full read: new capabilities may change which jobs fit).
CAPABILITIES_SQL = """
UPDATE worker
SET architectures = %(architectures)s, system_features = %(system_features)s,
    max_concurrent_builds = %(max_builds)s, max_concurrent_evals = %(max_evals)s,
    can_eval = %(eval)s, can_build = %(build)s, can_fetch = %(fetch)s,
    zone = %(zone)s, endpoint = %(endpoint)s
WHERE id = %(worker)s
RETURNING *
"""

# --- A single job's JobCompleted (sessions.reports) ---
# One statement: its open row finished and its job Completed (a fetch-only job's evaluation
# stays Fetching), and whether the row was a cluster member's.
_DONE = DISPATCHED_MACHINE.update(
    "done",
    "id = %(id)s AND worker_id = %(worker)s AND job_id = %(job)s AND cluster_attempt_id IS NULL",
    also=", log_tail = %(log_tail)s",
    returning="steps, evaluation_id, derivation_build_id",
)
_BUILDS = BUILD_MACHINE.update("build", "id IN (SELECT derivation_build_id FROM done)")
_EVALUATIONS = EVALUATION_MACHINE.update(
    "eval",
    "id IN (SELECT evaluation_id FROM done WHERE steps::text[] <> %(fetch_only)s::text[])",
)
COMPLETE_SINGLE_SQL = f"""
WITH done AS (
{_DONE}
), builds AS (
{_BUILDS}
), evaluations AS (
{_EVALUATIONS}
)
SELECT EXISTS (SELECT 1 FROM done),
       EXISTS (SELECT 1 FROM dispatched_job WHERE id = %(id)s AND cluster_attempt_id IS NOT NULL)
"""
