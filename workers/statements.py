"""The workers app's raw SQL, each statement and shared fragment named once, under the path that
runs it; the code modules import them from here."""

from gradient.jobs.models import JobKind
from gradient.wire.keys import key_kind_sql


def quarantined_sql(alias: str) -> str:
    """workers.health.quarantined_q's rule in SQL, over the worker row `alias`, at %(now)s."""
    return f"coalesce({alias}.quarantined_until > %(now)s, false)"


# --- A RequestJob and JobScores (workers.head, offers, assignment) ---
# What the worker's platform allows of a job row j beyond its architecture. PostgreSQL guesses
# that an array containment rarely holds (it keeps no element statistics while jobs need no
# feature), and would then sort the whole queue rather than walk the index to the window;
# wrapped in coalesce, the test counts as an even chance.
FEATURES_SQL = "coalesce(j.required_features <@ %(features)s, false)"
# The condition of the heads' indexes over every project (gradient.jobs.models.EVERY_PROJECT),
# stated by their walk alone: a walk of one project then cannot take those indexes.
EVERY_PROJECT_SQL = "j.created_at IS NOT NULL"
# The walks of the head: per architecture of the worker's (and, for a worker limited to some
# projects, per project of its), one index range in the single path's order up to the window,
# so that the jobs of other architectures and projects are never read; then the first window
# of them all. ({walk} is one range's rows.) The architectures are a VALUES list of as many
# parameters as the worker has: an unnested array parameter counts as many rows in a prepared
# statement's generic plan, which then looks too dear to use, and PostgreSQL would plan the
# offer afresh at every call (docs/design.md, "The statements stay bounded"). The walk over
# every project states the condition of its index alone (`every_project`), so a walk of one
# project reads its project's index.
ACCESS_SQL = """
SELECT h.* FROM (
    SELECT r.* FROM {architectures} AS a(architecture)
    CROSS JOIN LATERAL ({walk}) r
    WHERE (SELECT all_projects FROM worker WHERE id = %(worker)s)
    UNION ALL
    SELECT r.* FROM worker_projects wp
    CROSS JOIN {architectures} AS a(architecture)
    CROSS JOIN LATERAL ({walk_project}) r
    WHERE wp.worker_id = %(worker)s AND NOT (SELECT all_projects FROM worker WHERE id = %(worker)s)
) h
ORDER BY {order}
LIMIT {window}
"""
# The single jobs of one kind in one range of the head, along idx-<table>-head (or -project):
# startable, no member of an active cluster, no open assignment.
SINGLES_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, j.id, j.status,
       {substitute} AS substitute, j.project_id, p.name AS project, j.architecture,
       j.required_features, j.paths, j.prioritized, j.passed_over, j.created_at
FROM {table} j
JOIN project p ON p.id = j.project_id
WHERE j.architecture = a.architecture {project}
  AND j.status IN ({statuses}) AND NOT j.active_member AND """
    + FEATURES_SQL
    + """
  AND NOT EXISTS (SELECT 1 FROM dispatched_job d
                  WHERE d.job_id = {key} AND d.finished_at IS NULL)
ORDER BY j.prioritized DESC, j.created_at ASC
LIMIT {window}
"""
)


def access_sql(
    walk: str,
    order: str,
    window: int,
    architectures: int,
    project: str = "j.project_id",
    every_project: str = "",
) -> str:
    """A head part over every range the worker may take from, for a worker of this many
    architectures: `walk` has {project} where the condition on the range's project goes,
    `project` the column it tests; `every_project` is what the walk over every project
    states instead (its index's own condition)."""
    return ACCESS_SQL.format(
        walk=walk.replace("{project}", every_project),
        walk_project=walk.replace("{project}", f"AND {project} = wp.project_id"),
        order=order,
        window=window,
        architectures=_values(architectures),
    )


def _values(n: int) -> str:
    if not n:
        return "(SELECT NULL::text WHERE false)"
    return "(VALUES " + ", ".join(f"(%(arch_{i})s::text)" for i in range(n)) + ")"


NO_MEMBERS = """
SELECT NULL::text AS key, NULL::text AS kind, NULL::text AS project, NULL::text AS architecture,
       NULL::text[] AS required_features, NULL::text[] AS paths
WHERE false
"""
# The worker's head in one statement: the single jobs of each kind as rows (HeadJob's fields),
# and the members new to this connection as the JobOffer's own JSON, made by PostgreSQL;
# member rows of jobs that left the head are deleted, the new ones written. A row written in
# the last OFFER_GRACE stays: the dispatch pass offers a cluster before it marks it waiting, and the
# answer to that offer must outlive the worker's own offers in between.
HEAD_OFFER_SQL = (
    """
WITH singles AS ({singles}),
members AS ({members}),
dropped AS (
    DELETE FROM job_score s
    WHERE s.worker_id = %(worker)s AND s.job_id <> ALL(ARRAY(SELECT key FROM members))
      AND """
    + key_kind_sql("s.job_id")
    + """ = ANY(%(kinds)s::text[])
      AND coalesce(s.scored_at, s.offered_at) < %(grace_since)s
),
fresh AS (
    INSERT INTO job_score (worker_id, job_id, offered_at)
    SELECT %(worker)s, key, %(now)s FROM members ORDER BY key
    ON CONFLICT (worker_id, job_id) DO NOTHING
    RETURNING job_id
)
SELECT (SELECT coalesce(json_agg(json_build_array(
            key, kind, id, status, substitute, project_id, project, architecture,
            required_features, paths, prioritized, passed_over, created_at)
            ORDER BY kind, prioritized DESC, created_at), '[]') FROM singles)::text,
       (SELECT coalesce(json_agg(json_build_object(
            'job_id', m.key, 'kind', m.kind, 'project', m.project,
            'architecture', m.architecture, 'required_features', m.required_features,
            'paths', m.paths)), '[]')
        FROM members m JOIN fresh f ON f.job_id = m.key)::text
"""
)
# The offer runs its prepared statement's generic plan, planned once per connection: each of
# its walks stops at the window whatever the statistics say, so no value of the parameters
# needs a plan of its own, and a custom plan costs far more to make than to run
# (docs/design.md, "The statements stay bounded"). For the rest of the transaction: the offer's
# own, but for a caller's.
GENERIC_PLAN_SQL = "SELECT set_config('plan_cache_mode', 'force_generic_plan', true)"
NO_SINGLES = """
SELECT NULL::text AS key, NULL::text AS kind, NULL::uuid AS id, NULL::text AS status,
       NULL::bool AS substitute, NULL::bigint AS project_id, NULL::text AS project,
       NULL::text AS architecture, NULL::text[] AS required_features, NULL::text[] AS paths,
       NULL::bool AS prioritized, NULL::int AS passed_over, NULL::timestamptz AS created_at
WHERE false
"""
# A JobScores answer for members, in one statement, no model instances. Every writer of
# job_score inserts in (worker, job) order, so that two that overlap cannot deadlock.
RECORD_SCORES_SQL = """
INSERT INTO job_score (worker_id, job_id, offered_at, missing_count, missing_nar_size, scored_at)
SELECT %(worker)s, s.job_id, %(now)s, s.missing_count, s.missing_nar_size, %(now)s
FROM unnest(%(jobs)s::text[], %(counts)s::bigint[], %(sizes)s::bigint[])
     AS s(job_id, missing_count, missing_nar_size)
ORDER BY s.job_id
ON CONFLICT (worker_id, job_id) DO UPDATE
SET missing_count = EXCLUDED.missing_count, missing_nar_size = EXCLUDED.missing_nar_size,
    scored_at = EXCLUDED.scored_at
"""


def has_room_sql(kind: str) -> str:
    """SQL: the worker row w has room for one more job of `kind` (an SQL text expression): not
    draining, and fewer open assignments of the kind (held members included) than its slots."""
    return f"""NOT w.draining AND (SELECT count(*) FROM dispatched_job d
                   WHERE d.worker_id = w.id AND d.kind = {kind} AND d.finished_at IS NULL)
                  < CASE WHEN {kind} = '{JobKind.BUILD}' THEN w.max_concurrent_builds
                         ELSE w.max_concurrent_evals END"""


# The single path's claim, in one statement: the best of the ranked jobs that no other claim
# is taking right now (a claimer locks its job row, and the others pass over it instead of
# queueing behind its transaction: workers that score alike all prefer the same job), if the
# worker has room for it (its open assignments, held members included, below its slots, not
# draining, no seat of the aging reservation: {reserved}, the caller's); its assignment row by
# the single-assignment claim (gradient.jobs.claim, over every candidate's row, the picked one
# kept), the Assigned transition, the worker's idle slot cleared, and the head's first in line
# counted as passed over when another job went (skipped while another claim holds it: a
# count, never a wait). The job claimed comes back with its work (CLAIMED_WORK).
SINGLE_CLAIM_SQL = """
WITH pick AS (
    SELECT j.id FROM {table} j
    WHERE j.id = ANY(%(ids)s::uuid[]) AND j.status IN ({statuses}) AND NOT j.active_member
    ORDER BY array_position(%(ids)s::uuid[], j.id)
    LIMIT 1
    FOR NO KEY UPDATE {skip}
), room AS (
    SELECT NOT ({has_room}) AS no_room,
           {reserved}
               AS reserved
    FROM worker w WHERE w.id = %(worker)s
), claimed AS ({claim}), assigned AS (
{assigned}
), unidle AS (
    DELETE FROM idle_slot s
    WHERE s.worker_id = %(worker)s AND s.kind = '{kind}' AND EXISTS (SELECT 1 FROM claimed)
), overtaken AS (
    UPDATE {table} j SET passed_over = j.passed_over + 1
    FROM (SELECT f.id FROM {table} f
          WHERE f.id = %(first)s AND f.status IN ({statuses}) AND f.passed_over < 32767
          FOR NO KEY UPDATE SKIP LOCKED) f
    WHERE j.id = f.id AND f.id <> (SELECT id FROM pick) AND EXISTS (SELECT 1 FROM claimed)
)
SELECT (SELECT id FROM pick), (SELECT job_id FROM claimed), room.no_room, room.reserved,
       (SELECT work FROM claimed)
FROM room
"""
PICKED = """t.job_id = {picked}
  AND NOT EXISTS (SELECT 1 FROM room WHERE no_room OR reserved)"""
# The slot is recorded only while the worker still has room for the kind, and cleared when it
# has none: a claim that seated it since the RequestJob has taken the slot, and recording it
# again would seat the worker twice, a prepare lost. A claim holds the slot's row until it
# commits, so the row is locked first and the room counted by a statement of its own, which
# sees that commit: counted from before it, the write would put the slot back as the claim
# deletes it. Both go in one round trip (a pipeline), then the commit.
LOCK_IDLE_SQL = """
SELECT 1 FROM idle_slot WHERE worker_id = %(worker)s AND kind = %(kind)s::text FOR UPDATE
"""
RECORD_IDLE_SQL = f"""
WITH room AS (
    SELECT w.id, {has_room_sql("%(kind)s::text")} AS free
    FROM worker w WHERE w.id = %(worker)s
), kept AS (
    INSERT INTO idle_slot (worker_id, kind, recorded_at)
    SELECT id, %(kind)s::text, %(now)s FROM room WHERE free
    ON CONFLICT (worker_id, kind) DO UPDATE SET recorded_at = EXCLUDED.recorded_at
)
DELETE FROM idle_slot s USING room
WHERE s.worker_id = room.id AND s.kind = %(kind)s::text AND NOT room.free
"""
# A resend (a worker asks again every 10 s while a slot stays free) refreshes its slot in place:
# a row that still exists has room behind it, since every claim that takes a slot deletes its
# row, and an update cannot put back a row that a claim deleted. It returns the time replaced.
REFRESH_IDLE_SQL = """
UPDATE idle_slot s SET recorded_at = %(now)s
FROM idle_slot o
WHERE s.worker_id = %(worker)s AND s.kind = %(kind)s::text
  AND o.worker_id = s.worker_id AND o.kind = s.kind
RETURNING o.recorded_at
"""

# --- A member's report and an attempt's close (workers.health) ---
# Blamed seats, counted in the transaction that closes their attempts, after the seats' own
# write (`blamed`, a CTE of the caller's yielding worker_id). The rows are locked in id order
# (two closes blaming the same workers never wait on each other in a circle), and the increment
# is the UPDATE's own, on the row as last committed: two closes at once both count.
COUNT_BLAMED_SQL = f"""
, locked AS (
    SELECT id FROM worker WHERE id IN (SELECT worker_id FROM blamed) ORDER BY id
    FOR NO KEY UPDATE
)
UPDATE worker w SET blamed_in_row = w.blamed_in_row + 1
FROM locked WHERE w.id = locked.id
RETURNING w.id, w.blamed_in_row, {quarantined_sql("w")}
"""
# A seat of the worker succeeded (its report finished its row %(completed)s at %(finish_at)s, in
# an earlier statement of the same transaction): its streak starts again, and any probation ends.
COUNT_SUCCESS_SQL = """
UPDATE worker SET blamed_in_row = 0
WHERE id = %(worker)s AND blamed_in_row <> 0 AND EXISTS (
    SELECT 1 FROM dispatched_job d WHERE d.id = %(id)s AND d.worker_id = %(worker)s
      AND d.outcome = %(completed)s AND d.finished_at = %(finish_at)s)
"""
