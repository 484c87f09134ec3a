"""The clusters app's raw SQL, each statement and shared fragment named once, under the path
that runs it; the code modules import them from here. The rules the ORM shares with the SQL
(an open attempt, a backing off) stay beside their ORM twins in clusters.models."""

from clusters.models import (
    ATTEMPT_IS_OPEN_SQL,
    ATTEMPT_MACHINE,
    ATTEMPT_STARTED,
    BACKING_OFF_SQL,
    CLUSTER_MACHINE,
    ClusterStatus,
    no_open_attempt_sql,
)
from gradient.jobs.models import (
    BUILD_MACHINE,
    DISPATCHED_MACHINE,
    EVALUATION_MACHINE,
    JOB_MACHINES,
    BuildStatus,
    EvaluationStatus,
)
from gradient.jobs.statements import CLAIM_ROWS, START_CONDITION, claim_sql
from gradient.wire.keys import member_key_sql
from workers.statements import COUNT_BLAMED_SQL, FEATURES_SQL, quarantined_sql

# --- The dispatch pass (clusters.book, fleet, asking, scores, dispatch, reservation) ---
# The same numbering in SQL, over cluster_member's rows of one cluster.
ROLE_INDEX_SQL = "row_number() OVER (PARTITION BY role ORDER BY id) - 1"
# Clusters that can start: Queued, no open attempt, not backing off after a failed prepare,
# and every member's job startable (evaluation Queued, build Queued) with no open row
# anywhere. A member that cannot start holds its whole cluster back. Each cluster's attempts
# and members are aggregated in subqueries of their own, which PostgreSQL cannot flatten:
# joined flat, it hash-joined every attempt and job row of the history kept for each pass.
STARTABLE_SQL = f"""
SELECT c.id, c.same_zone, c.created_at, c.prioritized, c.waiting_since, c.offered_at
FROM cluster_job c
CROSS JOIN LATERAL (
    SELECT count(*) AS blocking FROM cluster_attempt a
    WHERE a.cluster_job_id = c.id
      AND ({ATTEMPT_IS_OPEN_SQL}
           OR ({BACKING_OFF_SQL}))
) t
CROSS JOIN LATERAL (
    SELECT bool_and(coalesce(e.status = '{EvaluationStatus.QUEUED}',
                             b.status = '{BuildStatus.QUEUED}')) AS queued,
           bool_or(EXISTS (
               SELECT 1 FROM dispatched_job d WHERE d.finished_at IS NULL AND d.job_id =
                   {member_key_sql("m.evaluation_id", "m.derivation_build_id")})) AS open
    FROM cluster_member m
    LEFT JOIN evaluation e ON e.id = m.evaluation_id
    LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
    WHERE m.cluster_job_id = c.id
) s
WHERE c.status = '{ClusterStatus.QUEUED}' AND t.blocking = 0 AND s.queued AND NOT s.open
ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC
LIMIT %(limit)s
"""
# The members of the clusters that can start, with what their seats and AssignJobs need, in
# the order the ORM would give them (ClusterMember.Meta.ordering). Each job row is a subquery
# of its own (its LIMIT keeps it so), probed by its key: joined flat, PostgreSQL hash-joined
# the job tables' whole history for each pass.
BOOK_MEMBERS_SQL = f"""
SELECT m.cluster_job_id, m.id, m.role, m.pin, m.evaluation_id, m.derivation_build_id,
       coalesce(e.architecture, b.architecture), coalesce(e.required_features, b.required_features),
       p.id, p.name, coalesce(b.cache_available, false), coalesce(e.paths, b.paths),
       {member_key_sql("m.evaluation_id", "m.derivation_build_id")}
FROM cluster_member m
LEFT JOIN LATERAL (
    SELECT e.architecture, e.required_features, e.project_id, e.paths FROM evaluation e
    WHERE e.id = m.evaluation_id LIMIT 1
) e ON true
LEFT JOIN LATERAL (
    SELECT b.architecture, b.required_features, b.project_id, b.cache_available, b.paths
    FROM derivation_build b WHERE b.id = m.derivation_build_id LIMIT 1
) b ON true
JOIN project p ON p.id = coalesce(e.project_id, b.project_id)
WHERE m.cluster_job_id = ANY(%s)
ORDER BY m.cluster_job_id, m.role, m.id
"""
# The connected workers that may be seated (but for the `reserved` ones), each with the kinds
# of its live idle slots: those with one at least ({join} JOIN), as the dispatch pass plans
# over, or every one (LEFT JOIN), as a reservation's target is planned over.
FLEET_SQL = """
SELECT w.id, w.name, w.zone, w.architectures, w.system_features, w.all_projects,
       w.can_eval, w.can_build,
       coalesce(array_agg(s.kind) FILTER (WHERE s.kind IS NOT NULL), '{{}}'), {quarantined}
FROM worker w
{join} JOIN idle_slot s ON s.worker_id = w.id AND s.recorded_at >= %(fresh)s
WHERE w.channel_name IS NOT NULL AND NOT w.draining AND w.revoked_at IS NULL
  AND w.id <> ALL(%(reserved)s::bigint[])
GROUP BY w.id
ORDER BY w.id
"""
# The projects of the workers FLEET_SQL read that may access only some.
WORKER_PROJECTS_SQL = (
    "SELECT worker_id, project_id FROM worker_projects WHERE worker_id = ANY(%s::bigint[])"
)
# The workers offered each member of the clusters offered lately that have not scored it
# yet, from idx-job_score-job-size (a row without a size is an unanswered offer). Which of
# them are idle is for the caller: as a second array in the index condition, the prepared
# statement's generic plan would probe the index once per (member, idle worker).
UNANSWERED_SQL = """
SELECT s.job_id, array_agg(s.worker_id) FROM job_score s
WHERE s.job_id = ANY(%(keys)s::text[]) AND s.missing_nar_size IS NULL
  AND s.offered_at > %(since)s
GROUP BY s.job_id
"""
# Of the candidate seats of each member (a bounded list, in the order they are to be asked),
# the first `per_member` that were never offered that member on their connections, offered
# now: one statement per cluster, whatever the size of the idle fleet.
ASK_SEATS_SQL = """
WITH unasked AS (
    SELECT p.worker_id, p.job_id,
           row_number() OVER (PARTITION BY p.job_id ORDER BY p.turn) AS n
    FROM unnest(%(workers)s::bigint[], %(keys)s::text[], %(turns)s::int[])
         AS p(worker_id, job_id, turn)
    WHERE NOT EXISTS (SELECT 1 FROM job_score s
                      WHERE s.worker_id = p.worker_id AND s.job_id = p.job_id)
), fresh AS (
    INSERT INTO job_score (worker_id, job_id, offered_at)
    SELECT u.worker_id, u.job_id, %(now)s FROM unasked u
    WHERE u.n <= %(per_member)s
    ORDER BY u.worker_id, u.job_id  -- the sessions' order (workers.offers): no deadlock
    ON CONFLICT (worker_id, job_id) DO NOTHING
    RETURNING worker_id, job_id
)
SELECT worker_id, array_agg(job_id) FROM fresh GROUP BY worker_id
"""
MARK_SQL = """
UPDATE cluster_job SET offered_at = %(now)s WHERE id = ANY(%(clusters)s::bigint[])
"""
# Each member job's cheapest answered scores (at most %(limit)s; one more tells that there are
# more) in the order of idx-job_score-job-size, (size, worker id), packed as big-endian int64
# pairs: an index-only scan of a few hundred entries per job instead of every score. The
# planner reads the rest of a job only when too few of its cheapest are left to decide
# (load_scores). Scores of workers without an idle slot come along and are dropped by the
# planner: filtering on the idle ones here costs more than it saves, though in a fleet where
# most workers are busy it makes the planner read more jobs in full.
CHEAPEST_SCORES_SQL = """
SELECT k.key, top.packed, top.n
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (
    SELECT string_agg(int8send(c.worker_id) || int8send(c.missing_nar_size), ''::bytea)
               AS packed,
           count(*) AS n
    FROM (SELECT s.worker_id, s.missing_nar_size FROM job_score s
          WHERE s.job_id = k.key AND s.missing_nar_size IS NOT NULL
          ORDER BY s.missing_nar_size, s.worker_id
          LIMIT %(limit)s + 1) c
) top
WHERE top.n > 0
"""
# Every answered score of some jobs (the planner drops those of workers it does not know),
# each job's from the index alone. No filter on the idle workers: binding thousands of ids
# costs more per query than the few extra rows do.
ALL_SCORES_SQL = """
SELECT k.key, top.packed
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (
    SELECT string_agg(int8send(s.worker_id) || int8send(s.missing_nar_size), ''::bytea) AS packed
    FROM job_score s WHERE s.job_id = k.key AND s.missing_nar_size IS NOT NULL
) top
WHERE top.packed IS NOT NULL
"""
# Some jobs' answered scores from some workers: a probe of the key's index per pair, cheaper
# than a job's full list while the workers are few (late in a pass, when most are taken).
SCORES_ON_SQL = """
SELECT s.job_id, string_agg(int8send(s.worker_id) || int8send(s.missing_nar_size), ''::bytea
                            ORDER BY s.missing_nar_size, s.worker_id)
FROM unnest(%(workers)s::bigint[]) AS w(id)
CROSS JOIN unnest(%(keys)s::text[]) AS k(key)
JOIN job_score s ON s.worker_id = w.id AND s.job_id = k.key
WHERE s.missing_nar_size IS NOT NULL
GROUP BY s.job_id
"""
# The score of each pinned member's job on its pin's worker, packed as CHEAPEST_SCORES_SQL's.
PIN_SCORES_SQL = """
SELECT s.job_id, int8send(s.worker_id) || int8send(s.missing_nar_size)
FROM unnest(%(keys)s::text[], %(workers)s::bigint[]) AS p(key, worker_id)
JOIN job_score s ON s.job_id = p.key AND s.worker_id = p.worker_id
WHERE s.missing_nar_size IS NOT NULL
"""

# The workers that did not accept in any of each cluster's failed prepares since its last
# attempt that started (planner.Cluster.avoid). Not the last prepare's alone: with two workers
# that never answer, the cluster went back and forth between them, one timeout after another.
UNRESPONSIVE_SQL = """
SELECT a.cluster_job_id, array_agg(DISTINCT d.worker_id)
FROM cluster_attempt a
JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.accepted_at IS NULL
WHERE a.cluster_job_id = ANY(%(clusters)s) AND a.outcome = %(prepare_failed)s
  AND a.created_at > COALESCE((SELECT max(s.created_at) FROM cluster_attempt s
                               WHERE s.cluster_job_id = a.cluster_job_id
                                 AND s.started_at IS NOT NULL), '-infinity')
GROUP BY a.cluster_job_id
"""
# The aging clock of every cluster as one pass saw it: started for the clusters in its book
# it did not place (unless running), stopped for the rest (placed, claimed, or no longer able
# to start). Rows another transaction holds are skipped, not waited for: the next pass
# catches up. Clusters past the book's limit count as not waiting.
NOTE_WAITING_SQL = f"""
WITH changed AS (
    SELECT c.id, c.id = ANY(%(waiting)s::bigint[]) AS waiting FROM cluster_job c
    WHERE (c.waiting_since IS NULL AND c.id = ANY(%(waiting)s::bigint[])
           AND c.status = '{ClusterStatus.QUEUED}')
       OR (c.waiting_since IS NOT NULL AND c.id <> ALL(%(waiting)s::bigint[]))
    FOR NO KEY UPDATE OF c SKIP LOCKED
)
UPDATE cluster_job c SET waiting_since = CASE WHEN changed.waiting THEN %(now)s::timestamptz END
FROM changed WHERE c.id = changed.id
"""

# --- Claims (the dispatch pass) and every close of an attempt (clusters.claim) ---
# Bounds the transaction's lock waits to GRADIENT_CLAIM_LOCK_TIMEOUT_MS: a frozen rival holding
# a row lock costs a claim or a close a bounded wait, not a hang. An expression, so that a
# statement may set it only where its WHERE says; its parameter is lock_timeout_params().
SET_LOCK_TIMEOUT = "set_config('lock_timeout', %(lock_timeout)s, true)"
BOUND_LOCK_WAITS_SQL = f"SELECT {SET_LOCK_TIMEOUT}"
# The claim's steps, one statement each, for one cluster or a batch of them alike, sent
# together (one round trip, then the commit). The attempts step writes only the attempts of
# claims that can win: every seat live (idle since the snapshot, its worker not quarantined,
# and locked here), the cluster Queued without an open attempt (idx-cluster_attempt-open),
# every member's job able to start; the later steps write only under an attempt it opened,
# so a claim that loses there writes nothing. Every seat is locked before any cluster: their
# count is a one-time filter, evaluated before the first claim's row is read.
OPEN_ATTEMPTS_SQL = f"""
WITH seats AS MATERIALIZED (
    SELECT t.cluster FROM idle_slot s
    JOIN json_to_recordset(%(seats)s::json)
         AS t(worker bigint, kind text, since timestamptz, cluster bigint, attempt uuid)
      ON s.worker_id = t.worker AND s.kind = t.kind
    JOIN worker w ON w.id = s.worker_id
    WHERE s.recorded_at >= t.since AND NOT {quarantined_sql("w")}
    ORDER BY s.worker_id, s.kind
    FOR UPDATE OF s
), live AS (
    SELECT cluster, count(*) AS n FROM seats GROUP BY cluster
), unstartable AS MATERIALIZED (
    SELECT t.attempt_id FROM {CLAIM_ROWS}
    WHERE NOT ({START_CONDITION})
)
INSERT INTO cluster_attempt (id, cluster_job_id, created_at)
SELECT c.id, c.cluster, c.created_at
FROM json_to_recordset(%(clusters)s::json)
     AS c(id uuid, cluster bigint, created_at timestamptz, seats int)
LEFT JOIN live ON live.cluster = c.cluster
WHERE (SELECT count(*) FROM seats) >= 0
  AND coalesce(live.n, 0) = c.seats
  AND NOT EXISTS (SELECT 1 FROM unstartable u WHERE u.attempt_id = c.id)
  AND EXISTS (SELECT 1 FROM cluster_job j
              WHERE j.id = c.cluster AND j.status = ANY(%(claimable)s) FOR SHARE)
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING cluster_job_id
"""
# A member's row goes in only under its attempt, opened by the step before. One lookup of the
# rows' own attempts, hashed, rather than a probe per row: a probe's plan follows the table's
# stats, and an attempt table small when analyzed was scanned whole for every member.
ATTEMPT_OPENED = """(t.attempt_id IS NULL OR t.attempt_id IN (
     SELECT a.id FROM cluster_attempt a WHERE a.id = ANY(%(attempts)s::uuid[])))"""
# The members: the single-assignment claim statement (gradient.jobs.claim), a row per member;
# one that inserts nothing (its job is open elsewhere) rolls the transaction back. Then the
# spec's Assigned transition of the builds claimed under the attempts opened.
CLAIM_MEMBERS_SQL = claim_sql(ATTEMPT_OPENED)
ASSIGN_BUILDS_SQL = BUILD_MACHINE.update(
    "assign",
    f"id IN (SELECT t.build_id FROM {CLAIM_ROWS} WHERE {ATTEMPT_OPENED})",
)
# The seats of the attempts opened, taken; those of a loser stay as they were.
TAKE_SEATS_SQL = """
DELETE FROM idle_slot s
USING json_to_recordset(%(seats)s::json)
      AS t(worker bigint, kind text, cluster bigint, attempt uuid)
WHERE s.worker_id = t.worker AND s.kind = t.kind
  AND t.attempt IN (SELECT a.id FROM cluster_attempt a WHERE a.id = ANY(%(attempts)s::uuid[]))
RETURNING t.cluster
"""


def _close_sql(moves_cluster: bool) -> str:
    """The spec's Close, one statement of three guarded writes: the attempt closes with its
    outcome only from a state its machine allows (PrepareFailed only before the start), and
    only then are its open member rows abandoned and, when asked, its cluster moved, in the
    lock order above (the attempt, its rows, its cluster: the sub-statements of a WITH run in
    no set order, so the cluster's reads the count of the abandoned rows). Asked to move the
    cluster, the attempt closes only if its cluster may make that move."""
    movable = (
        " AND EXISTS (SELECT 1 FROM cluster_job c WHERE c.id = cluster_attempt.cluster_job_id"
        f" AND {CLUSTER_MACHINE.guard('c', 'cluster_from')})"
    )
    closed = ATTEMPT_MACHINE.update(
        "close",
        "id = %(attempt)s" + (movable if moves_cluster else ""),
        returning="id, cluster_job_id",
    )
    abandoned = DISPATCHED_MACHINE.update(
        "abandon", "cluster_attempt_id = (SELECT id FROM closed)", returning="1"
    )
    cluster = CLUSTER_MACHINE.update(
        "cluster",
        "id = (SELECT cluster_job_id FROM closed) AND (SELECT count(*) FROM abandoned) >= 0",
    )
    moved = f", cluster AS ({cluster})" if moves_cluster else ""
    return (
        f"WITH closed AS ({closed}), abandoned AS ({abandoned}){moved}\n"
        "SELECT cluster_job_id FROM closed"
    )


CLOSE_ATTEMPT_SQL = {moves: _close_sql(moves) for moves in (False, True)}

# --- A member's acceptance, and the start (clusters.coordinator) ---
# An AssignJobResponse(accepted) in one statement, its own transaction: one round trip, the
# last acceptance's start included. In the lock order of clusters.claim:
# - held: the worker's open row of the job, a single's or a member's (none: NotAllowed). Lock
#   waits are bounded as bound_lock_waits bounds them, set here before the first lock is taken
#   (a SET LOCAL would cost a round trip of its own).
# - attempt: the member's attempt, locked: acceptances of one attempt queue here.
# - seats: every row of the attempt, locked to read them as last committed (not as of this
#   statement's snapshot): of two last acceptances at once, the second sees the first.
# - accept: the acceptance of the open member row, kept as first given.
# - started, running, evaluating: the spec's start_cluster_attempt, once every row is accepted
#   and open, three guarded writes: the attempt Open -> Started (while its cluster may go
#   Running), its cluster Queued -> Running and counting it (so a failed prepare never spends
#   the budget), the member evaluations Queued -> EvaluatingFlake (builds went Building at the
#   claim). There is no start apart from this statement.
# - members: once started, each member's (role, index) (clusters.book), for the roster.
# A row per seat with its worker when this acceptance started the attempt, else one row.
# Times are the database's clock as each write happens, after the locks: a time taken before
# the statement would be older than an acceptance committed while this one waited for the
# attempt, and the attempt would have started before that member accepted.
_STARTED = ATTEMPT_MACHINE.update(
    "start",
    "id = (SELECT id FROM attempt) AND EXISTS (SELECT 1 FROM accept)"
    " AND NOT EXISTS (SELECT 1 FROM seats"
    " WHERE finished_at IS NOT NULL OR (accepted_at IS NULL AND NOT mine))"
    " AND EXISTS (SELECT 1 FROM cluster_job c WHERE c.id = cluster_attempt.cluster_job_id"
    f" AND {CLUSTER_MACHINE.guard('c', 'run_from')})",
    to=ATTEMPT_STARTED,
    at="clock_timestamp()",
    returning="cluster_job_id",
)
_RUNNING = CLUSTER_MACHINE.update(
    "run",
    "id = (SELECT cluster_job_id FROM started)",
    at="clock_timestamp()",
    also=", attempts = attempts + 1",
)
_EVALUATING = EVALUATION_MACHINE.update(
    "flake", "id = ANY(ARRAY(SELECT evaluation_id FROM seats)) AND EXISTS (SELECT 1 FROM running)"
)
ACCEPT_SQL = f"""
WITH held AS (
    SELECT cluster_attempt_id, {SET_LOCK_TIMEOUT}
    FROM dispatched_job
    WHERE worker_id = %(worker)s AND job_id = %(job)s AND finished_at IS NULL
), attempt AS (
    SELECT id FROM cluster_attempt WHERE id = (SELECT cluster_attempt_id FROM held)
    FOR NO KEY UPDATE
), seats AS (
    SELECT id, job_id, worker_id, evaluation_id, accepted_at, finished_at,
           worker_id = %(worker)s AND job_id = %(job)s AS mine
    FROM dispatched_job WHERE cluster_attempt_id = (SELECT id FROM attempt)
    ORDER BY id
    FOR SHARE
), accept AS (
    UPDATE dispatched_job SET accepted_at = coalesce(accepted_at, clock_timestamp())
    WHERE id = (SELECT id FROM seats WHERE mine AND finished_at IS NULL)
    RETURNING id
), started AS (
{_STARTED}
), running AS (
{_RUNNING}
), evaluating AS (
{_EVALUATING}
), members AS (
    SELECT {member_key_sql("evaluation_id", "derivation_build_id")} AS job_id, role,
           {ROLE_INDEX_SQL} AS index
    FROM cluster_member WHERE cluster_job_id = (SELECT id FROM running)
)
SELECT h.cluster_attempt_id, EXISTS (SELECT 1 FROM accept),
       s.worker_id, w.name, w.zone, w.endpoint, coalesce(m.role, '?'), coalesce(m.index, 0)
FROM held h
LEFT JOIN (seats s JOIN worker w ON w.id = s.worker_id LEFT JOIN members m ON m.job_id = s.job_id)
  ON EXISTS (SELECT 1 FROM running)
"""

# --- A member's report: the verdict, and blame (clusters.settlement, blame) ---
# Every member row of an attempt with what the verdict reads (its state: key, primary,
# outcome, failure kind, dead: its job final or gone, aborted: its job Aborted) and the
# attempt and cluster it belongs to, in job-key order. {attempt} is the attempt's id, or
# REPORTED_ATTEMPT.
VERDICT_INPUT_SQL = """
SELECT a.id, a.cluster_job_id, a.started_at IS NOT NULL, a.finished_at IS NOT NULL,
       c.attempts, c.retry_budget,
       d.id, d.job_id, d.worker_id, d.evaluation_id, d.derivation_build_id, d.finished_at,
       d.outcome, d.failure_kind,
       EXISTS (SELECT 1 FROM cluster_member m
               WHERE m.cluster_job_id = a.cluster_job_id AND m."primary"
                 AND (m.evaluation_id = d.evaluation_id
                      OR m.derivation_build_id = d.derivation_build_id)),
       coalesce(coalesce(e.status, b.status) = ANY(%(dead)s), true),
       coalesce(coalesce(e.status, b.status) = ANY(%(aborted)s), false)
FROM cluster_attempt a
JOIN cluster_job c ON c.id = a.cluster_job_id
JOIN dispatched_job d ON d.cluster_attempt_id = a.id
LEFT JOIN evaluation e ON e.id = d.evaluation_id
LEFT JOIN derivation_build b ON b.id = d.derivation_build_id
WHERE a.id = {attempt}
ORDER BY d.job_id
"""
ATTEMPT_MEMBERS_SQL = VERDICT_INPUT_SQL.format(attempt="%(attempt)s")
# A member's report opens its transaction with these four statements (a fifth for a success:
# workers.health.COUNT_SUCCESS_SQL), sent together (a psycopg pipeline: one round trip). Each
# runs on a snapshot taken when it starts, so the ones after the lock see every report
# committed before it.
# The reporting row's attempt: the row is this worker's, of this job, under this id.
REPORTED_ATTEMPT = """(SELECT cluster_attempt_id FROM dispatched_job
                       WHERE id = %(id)s AND worker_id = %(worker)s AND job_id = %(job)s)"""
# bound_lock_waits, for a member's row only: an assignment that is no member's (a single's
# JobFailed, handled in the same transaction) keeps its lock waits as they were.
BOUND_MEMBER_LOCK_WAITS_SQL = f"""
SELECT {SET_LOCK_TIMEOUT} WHERE {REPORTED_ATTEMPT} IS NOT NULL
"""
# Reports of one attempt queue on its row (resolve_attempt locks it first too).
LOCK_ATTEMPT_SQL = f"SELECT 1 FROM cluster_attempt WHERE id = {REPORTED_ATTEMPT} FOR UPDATE"
# The row finishes with the report if it is open (its guarded write), and a Completed only
# once the attempt has started; the row comes back when it did.
FINISH_REPORTED_SQL = DISPATCHED_MACHINE.update(
    "finish",
    "id = %(id)s AND worker_id = %(worker)s AND job_id = %(job)s"
    " AND EXISTS (SELECT 1 FROM cluster_attempt a WHERE a.id = dispatched_job.cluster_attempt_id"
    " AND (a.started_at IS NOT NULL OR %(finish_to)s <> %(completed)s))",
    also=", failure_kind = %(kind)s, error = %(error)s, log_tail = %(log_tail)s",
)
# The verdict's input, the report included; no row for an assignment that is no member's.
REPORTED_MEMBERS_SQL = VERDICT_INPUT_SQL.format(attempt=REPORTED_ATTEMPT)
# Settling, in the lock order of clusters.claim (the attempt, locked already, then its rows,
# its cluster, the member jobs): close_cluster_attempt (close, abandon the open rows, move the
# cluster: one statement), then in one round trip (a pipeline) every member job's guarded
# write, by kind, each job to its own target.
MOVE_SQL = {kind: machine.update_each("jobs") for kind, machine in JOB_MACHINES.items()}
BLAME_SQL = (
    """
WITH blamed AS (
    UPDATE dispatched_job SET blame = %(how)s
    WHERE cluster_attempt_id = %(attempt)s AND blame IS NULL
      AND CASE WHEN %(seat)s::uuid IS NULL THEN accepted_at IS NULL
               ELSE id = %(seat)s::uuid END
    RETURNING worker_id
)"""
    + COUNT_BLAMED_SQL
)

# --- The sweeps: recovery, the hourly retention (clusters.recovery, retention) ---
MEMBER_KEY = member_key_sql("m.evaluation_id", "m.derivation_build_id")
# Each open started attempt's members are aggregated in a subquery of their own, which
# PostgreSQL cannot flatten: joined flat, it hash-joined every member of the history kept.
STARTED_WITH_LOST_OR_DEAD_SQL = f"""
SELECT a.id, s.dead, s.lost
FROM cluster_attempt a
CROSS JOIN LATERAL (
    SELECT bool_or(e.status = ANY(%(dead_evals)s) OR b.status = ANY(%(dead_builds)s)) AS dead,
           bool_or(d.id IS NULL OR w.channel_name IS NULL OR w.last_seen_at < %(silent)s)
               AS lost
    FROM cluster_member m
    LEFT JOIN evaluation e ON e.id = m.evaluation_id
    LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
    LEFT JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.finished_at IS NULL
        AND d.job_id = {MEMBER_KEY}
    LEFT JOIN worker w ON w.id = d.worker_id
    WHERE m.cluster_job_id = a.cluster_job_id
) s
WHERE {ATTEMPT_IS_OPEN_SQL} AND a.started_at IS NOT NULL
"""
# A cluster's members as the verdict reads a lost one, the cluster locked; no rows once it
# has an open attempt or is no longer Running.
STRANDED_MEMBERS_SQL = f"""
WITH c AS (
    SELECT id, attempts, retry_budget FROM cluster_job
    WHERE id = %(cluster)s AND status = %(running)s
      AND {no_open_attempt_sql("%(cluster)s")}
    FOR UPDATE
)
SELECT c.attempts, c.retry_budget,
       {MEMBER_KEY},
       m.evaluation_id, m.derivation_build_id, m."primary",
       coalesce(e.status, b.status) = ANY(%(dead)s),
       coalesce(e.status, b.status) = ANY(%(aborted)s)
FROM c
LEFT JOIN cluster_member m ON m.cluster_job_id = c.id
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
ORDER BY 3
"""
# Ordered by id and resumed after the last batch, so each batch reads only rows not yet seen.
EXPIRED_SQL = f"""
SELECT c.id FROM cluster_job c
WHERE c.id > %(after)s
  AND c.status = ANY(%(finished)s)
  AND (c.updated_at < %(cutoff)s
       OR NOT EXISTS (SELECT 1 FROM cluster_member m WHERE m.cluster_job_id = c.id))
  AND {no_open_attempt_sql("c.id")}
ORDER BY c.id
LIMIT %(batch)s
FOR UPDATE OF c SKIP LOCKED
"""
# The batch's member rows lose their attempt and the output kept with them, in one write of
# each row: the attempts' ON DELETE SET NULL then finds none left to write.
FORGET_OUTPUT_SQL = """
UPDATE dispatched_job d SET cluster_attempt_id = NULL, error = NULL, log_tail = NULL
FROM cluster_attempt a
WHERE a.cluster_job_id = ANY(%s) AND d.cluster_attempt_id = a.id
"""

# --- A RequestJob (clusters.wake, head, reservation) ---
# A wake-up can place something only while a cluster waits for seats (Queued, no open attempt)
# or a reservation waits for its seats to be idle. Otherwise idle workers asking for work would
# keep a pass running back to back, and the one wake-up that completes a placement would
# queue behind it.
WAITING_SQL = f"""
SELECT EXISTS (SELECT 1 FROM cluster_job c WHERE c.status = '{ClusterStatus.QUEUED}'
               AND {no_open_attempt_sql("c.id")})
    OR EXISTS (SELECT 1 FROM cluster_reservation r WHERE r.released_at IS NULL)
"""
# The members of one kind in one range of the head for a worker (protocol.md): those of the
# clusters waiting to start (note_waiting marks them) along idx-cluster_job-waiting (or its
# per-project twin) in the planner's order, up to the window; a cluster none of whose members
# the worker could seat takes no place in it. The clusters are cut to the window first, in a
# subquery of their own: with the members' order in the same sort, PostgreSQL trusting stale
# statistics (a queue analyzed nearly empty) walked the members of every waiting cluster and
# sorted them all. Each cluster's members are a subquery with a LIMIT, which keeps PostgreSQL
# from flattening them: joined flat, it guessed that few members of waiting clusters are queued
# (most job rows are history) and hash-joined every member and job row. Columns as
# workers.offers' members. (workers.head.access_sql runs one walk per range.)
SEATABLE_MEMBERS = (
    """
SELECT j.id, p.name AS project, j.architecture, j.required_features, j.paths,
       m.role, m.id AS member
FROM cluster_member m
JOIN {table} j ON j.id = m.{member_column}
JOIN project p ON p.id = j.project_id
WHERE m.cluster_job_id = c.id AND (m.pin IS NULL OR m.pin = %(name)s)
  AND j.status IN ({queued}) AND j.architecture = a.architecture AND """
    + FEATURES_SQL
    + """
"""
)
MEMBER_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, x.project,
       x.architecture, x.required_features::text[] AS required_features, x.paths,
       c.prioritized, c.created_at, c.id AS cluster, x.role, x.member
FROM (
    SELECT c.id, c.prioritized, c.created_at FROM cluster_job c
    CROSS JOIN LATERAL ("""
    + SEATABLE_MEMBERS
    + """ LIMIT 1) seatable
    WHERE c.waiting_since IS NOT NULL {project_of_cluster}
      AND """
    + no_open_attempt_sql("c.id")
    + """
    ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC
    LIMIT {window}
) c
CROSS JOIN LATERAL ("""
    + SEATABLE_MEMBERS
    + """ ORDER BY m.role, m.id LIMIT {window}) x
ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC, x.role, x.member
LIMIT {window}
"""
)
# As a part of its own, the members pinned to the worker whatever their place, from
# idx-cluster_member-pin: each pinned member's cluster and job are a subquery of their own, so
# that no plan starts from the waiting clusters or the queued jobs instead.
PINNED_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, x.project,
       x.architecture, x.required_features::text[] AS required_features, x.paths,
       x.prioritized, x.created_at, x.cluster, m.role, m.id AS member
FROM cluster_member m
CROSS JOIN LATERAL (
    SELECT j.id, p.name AS project, j.architecture, j.required_features, j.paths,
           c.prioritized, c.created_at, c.id AS cluster
    FROM cluster_job c, {table} j
    JOIN project p ON p.id = j.project_id
    WHERE c.id = m.cluster_job_id AND j.id = m.{member_column}
      AND c.waiting_since IS NOT NULL {project_of_cluster}
      AND """
    + no_open_attempt_sql("c.id")
    + """
      AND j.status IN ({queued}) AND j.architecture = a.architecture AND """
    + FEATURES_SQL
    + """
    LIMIT 1
) x
WHERE m.pin = %(name)s
ORDER BY x.prioritized DESC, x.created_at ASC, x.cluster ASC, m.role, m.id
LIMIT {window}
"""
)
MEMBER_ORDER = "h.prioritized DESC, h.created_at ASC, h.cluster ASC, h.role, h.member"
# The part's rows as the offer reads them.
# A quarantined worker seats no member (workers.health), so none is offered to it: read from its
# row, since a quarantine can begin while the session runs.
MEMBER_PART = f"""
SELECT key, kind, project, architecture, required_features, paths FROM ({{part}}) x
WHERE NOT (SELECT {quarantined_sql("w")} FROM worker w WHERE w.id = %(worker)s)
"""


def seat_reserved_sql(kind: str) -> str:
    """SQL: the worker row w holds a seat of `kind` in the active reservation (the single path
    gives such a worker no job of that kind: workers.assignment.request_job)."""
    return f"""EXISTS (SELECT 1 FROM reservation_seat s
                   JOIN cluster_reservation r ON r.id = s.reservation_id
                   WHERE s.worker_id = w.id AND s.kind = '{kind}' AND r.released_at IS NULL)"""
