"""JobOffer and JobScores: the head of the queue offered to a worker, and what it would fetch.

A worker's job_score rows are its offers on this connection (attach deletes them): a row is
written when a job is offered, without a score, and the answer fills it in. An offer sends the
head's jobs that have no row yet, so a worker scores a job once per connection, whichever
process offered it; and it deletes the rows of jobs that left the head, so a worker holds rows
for its head alone (about twice the window per kind), however deep the queue.
"""

from django.db import connection as db_connection
from django.utils import timezone

from gradient.jobs.models import JobKind
from gradient.postgresql.arrays import int_array, text_array
from workers.head import job_table, offerable, platform_params, singles_sql
from workers.models import Worker
from workers.protocol import JobOffer, OfferedJob

# A part of the head as the offer reads it: one row per job, with what a JobOffer names.
OFFERED_COLUMNS = "key, kind, project, architecture, required_features, paths, member"

SINGLES_PART = """
SELECT '{prefix}' || h.id::text AS key, '{kind}'::text AS kind, h.project, h.architecture,
       h.required_features, h.paths, false AS member
FROM ({singles}) h
"""

OFFER_SQL = """
WITH head AS ({parts}),
dropped AS (
    DELETE FROM job_score s
    WHERE s.worker_id = %(worker)s AND s.job_id <> ALL(ARRAY(SELECT key FROM head))
),
fresh AS (
    INSERT INTO job_score (worker_id, job_id, offered_at)
    SELECT %(worker)s, key, %(now)s FROM head
    ON CONFLICT (worker_id, job_id) DO NOTHING
    RETURNING job_id
)
SELECT coalesce(json_agg(json_build_object(
           'job_id', h.key, 'kind', h.kind, 'project', h.project,
           'architecture', h.architecture, 'required_features', h.required_features,
           'paths', h.paths) ORDER BY h.kind, h.member, h.key), '[]')::text,
       coalesce(bool_or(h.member), false)
FROM head h JOIN fresh f ON f.job_id = h.key
"""


class RenderedOffer:
    """A JobOffer as the frame to send, made by PostgreSQL (`jobs` parses it, for tests);
    `members` tells whether it offers a cluster member."""

    def __init__(self, jobs_json: str, members: bool = False):
        self.text = '{"type":"JobOffer","jobs":' + jobs_json + "}"
        self.members = members

    def frame(self) -> str:
        return self.text

    @property
    def jobs(self) -> list[OfferedJob]:
        return JobOffer.model_validate_json(self.text).jobs


def singles_parts(worker: Worker) -> list[str]:
    """The single jobs' part of each kind's head this worker can serve."""
    parts = []
    for how in (offerable(worker, kind) for kind in JobKind.values):
        if how is not None:
            _, prefix = job_table(how.kind)
            singles = singles_sql(how)
            parts.append(SINGLES_PART.format(prefix=prefix, kind=how.kind, singles=singles))
    return parts


def offer_head(worker: Worker, member_parts=()) -> RenderedOffer | None:
    """Offer the worker its head's jobs it has not been offered on this connection, and forget
    the offers of jobs that left its head; None when there is nothing new. `member_parts` are
    the members' parts (clusters.tracking.member_head_parts), in OFFERED_COLUMNS."""
    if worker.draining:
        return None
    parts = [*singles_parts(worker), *member_parts]
    if not parts:
        return None
    sql = OFFER_SQL.format(parts=" UNION ".join(f"({part})" for part in parts))
    with db_connection.cursor() as cursor:
        cursor.execute(sql, {**platform_params(worker), "now": timezone.now()})
        jobs_json, members = cursor.fetchone()
    if jobs_json == "[]":
        return None
    return RenderedOffer(jobs_json, members)


# A JobScores answer in one statement, no model instances. A score for a job not offered is
# kept too: the next offer forgets it unless the job is at the worker's head.
RECORD_SCORES_SQL = """
INSERT INTO job_score (worker_id, job_id, offered_at, missing_count, missing_nar_size, scored_at)
SELECT %(worker)s, s.job_id, %(now)s, s.missing_count, s.missing_nar_size, %(now)s
FROM unnest(%(jobs)s::text[], %(counts)s::bigint[], %(sizes)s::bigint[])
     AS s(job_id, missing_count, missing_nar_size)
ON CONFLICT (worker_id, job_id) DO UPDATE
SET missing_count = EXCLUDED.missing_count, missing_nar_size = EXCLUDED.missing_nar_size,
    scored_at = EXCLUDED.scored_at
"""


def record_scores(worker_id: int, scores) -> int:
    """Store a JobScores answer. One score per job: PostgreSQL refuses an upsert that touches
    one row twice."""
    if not scores:
        return 0
    with db_connection.cursor() as cursor:
        cursor.execute(
            RECORD_SCORES_SQL,
            {
                "worker": worker_id,
                "now": timezone.now(),
                "jobs": text_array([s.job_id for s in scores]),
                "counts": int_array(s.missing_count for s in scores),
                "sizes": int_array(s.missing_nar_size for s in scores),
            },
        )
    return len(scores)
