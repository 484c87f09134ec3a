"""JobOffer and JobScores: what each worker was offered, and what it would have to fetch.

A worker is offered every job it could take, cluster members among them, once per connection
(a pair never scored counts as the most expensive seat). Before each RequestJob is answered,
the session asks for the jobs the worker has not been offered yet: those without a job_score
row (the worker's answers) and not offered since the last full read while unanswered (the
mark's `pending`, in the session's memory like the connection itself). A reference worker
answers each offer before its next RequestJob, and the session handles its frames in order,
so an answered job is skipped by its row; an offer left unanswered for FULL_READ_EVERY is
made again by the next read that meets it (a full read, or its row rewritten). Offers used
to write a job_score row per pair before the answer wrote it again: at 500 workers about
10,000 pairs a second, and the offer PostgreSQL's costliest statement.

Finding the new jobs used to read every startable job against the worker's job_score rows,
a few hundred anti-join probes per RequestJob at a busy queue. A session now keeps an
OfferMark: the oldest transaction still running when its last offer read the jobs. A job
that became startable since was written by that transaction or a later one, so the next
offer reads only job rows whose last writer (written_xid, indexed) is no older. The mark is
dropped (one full read) every FULL_READ_EVERY seconds and when the worker's capabilities
change, so that a change no job row shows (the worker's project access) is picked up within
that time.
"""

import time
from dataclasses import dataclass, field

from django.db import connection as db_connection
from django.utils import timezone

from gradient.jobs.models import EvaluationStatus, JobKind
from gradient.postgresql.arrays import int_array, text_array
from workers.assignment import FETCH_STEPS, JOB_FILTER_SQL, job_filter_params, job_table, offerable
from workers.models import Worker
from workers.protocol import JobOffer, OfferedJob

OFFER_BATCH = 200
FULL_READ_EVERY = 60.0  # seconds


@dataclass
class OfferMark:
    """A session's watermark: the id of the oldest transaction running when its last offer
    read the jobs, as text (PostgreSQL's 64-bit xid8), and when it last read them all; and the
    jobs offered since that full read that the worker has not scored yet."""

    xmin: str | None = None
    full_read_at: float = float("-inf")
    pending: dict[str, float] = field(default_factory=dict)  # job key -> when offered
    quiet: bool = False  # the last read found nothing new: the next asks WRITTEN_SINCE_SQL first

    def since(self) -> str | None:
        """The xmin to read from, None for a full read."""
        if time.monotonic() - self.full_read_at > FULL_READ_EVERY:
            return None
        return self.xmin

    def reset(self) -> None:
        """New capabilities: read every job, and offer again what is still unanswered."""
        self.xmin = None
        self.pending.clear()

    def unanswered(self) -> list[str]:
        """The jobs offered less than FULL_READ_EVERY ago and not answered: not offered again.
        Older ones are forgotten, so the next read that meets them offers them again."""
        stale = time.monotonic() - FULL_READ_EVERY
        for key in [key for key, at in self.pending.items() if at < stale]:
            del self.pending[key]
        return sorted(self.pending)

    def offered(self, keys) -> None:
        now = time.monotonic()
        self.pending.update((key, now) for key in keys)

    def answered(self, keys) -> None:
        """A JobScores answer: its jobs have job_score rows now, which the offers skip."""
        for key in keys:
            self.pending.pop(key, None)


# The jobs of one kind this worker may take and has not been offered yet, cluster members
# among them (except to a fetch-only worker: a member evaluation always runs as one job),
# first come first offered. With a mark, only the job rows written since: written_xid is the
# row's last writing transaction (a trigger's, jobs migration 0006), indexed, so a marked read
# finds the few rows written since the last offer instead of testing every startable job.
WRITTEN_SINCE = "j.written_xid >= %(since)s::xid8"
UNOFFERED_SQL = (
    """
SELECT '{prefix}' || j.id::text AS key, '{kind}' AS kind, p.name, j.architecture,
       j.required_features, j.paths, j.prioritized, j.created_at
FROM {table} j
JOIN project p ON p.id = j.project_id
WHERE {since_filter}
  AND """
    + JOB_FILTER_SQL
    + """
  AND NOT EXISTS (SELECT 1 FROM job_score s
                  WHERE s.worker_id = %(worker)s AND s.job_id = '{prefix}' || j.id::text)
  AND NOT ('{prefix}' || j.id::text = ANY(%(pending)s::text[]))
  {member_filter}
ORDER BY j.prioritized DESC, j.created_at ASC
LIMIT %(limit)s
"""
)
# Both kinds' unoffered jobs in one statement and one row, with the xmin of the statement's
# own snapshot (there even when nothing is new).
#
# The jobs come as the JobOffer's own JSON (OfferedJob's fields), made by PostgreSQL: turning
# a hundred rows of arrays into Python values and models, then into JSON again, was a fifth
# of a daphne's GIL time in the throughput benchmark.
OFFER_SQL = """
WITH fresh AS ({parts})
SELECT pg_snapshot_xmin(pg_current_snapshot())::text,
       coalesce(json_agg(json_build_object(
           'job_id', key, 'kind', kind, 'project', name, 'architecture', architecture,
           'required_features', coalesce(required_features, '{{}}'),
           'paths', coalesce(paths, '{{}}'))
           ORDER BY prioritized DESC, created_at ASC), '[]')::text,
       coalesce(string_agg(key, ','), ''),
       coalesce((SELECT max(n) FROM (SELECT count(*) AS n FROM fresh GROUP BY kind) k), 0)
FROM fresh
"""


# Whether any job row was written since a mark, and the xmin of this statement's snapshot: the
# last entry of each written_xid index, so PostgreSQL plans it in microseconds. A marked read
# can only find rows written since its mark: when none are, it would find nothing, and this
# moves the mark on as that read would have. Asked only after a read that found nothing (a
# reconnect storm, an idle fleet), where planning OFFER_SQL for every RequestJob was most of
# PostgreSQL's work: 0.9 ms a call in a storm's statement log, to return no job.
WRITTEN_SINCE_SQL = """
SELECT pg_snapshot_xmin(pg_current_snapshot())::text,
       coalesce((SELECT max(written_xid) FROM evaluation) >= %(since)s::xid8, false)
    OR coalesce((SELECT max(written_xid) FROM derivation_build) >= %(since)s::xid8, false)
"""


class RenderedOffer:
    """A JobOffer as the frame to send, made without models (`jobs` parses it, for tests)."""

    def __init__(self, jobs_json: str):
        self.text = '{"type":"JobOffer","jobs":' + jobs_json + "}"

    def frame(self) -> str:
        return self.text

    @property
    def jobs(self) -> list[OfferedJob]:
        return JobOffer.model_validate_json(self.text).jobs


def new_offers(
    worker_id: int, worker: Worker | None = None, mark: OfferMark | None = None
) -> RenderedOffer | None:
    """Jobs this worker could take that it has not been offered yet, cluster members among
    them. A caller that has the worker's row passes it (one query less per RequestJob); a
    session passes its mark, read and moved on here, which remembers what was offered (without
    one, every job not yet scored comes back)."""
    worker = worker or Worker.objects.get(pk=worker_id)
    if worker.draining:
        return None
    since = mark.since() if mark is not None else None
    if since is not None and mark.quiet and not written_since(mark, since):
        return None
    pending = text_array(mark.unanswered() if mark is not None else [])
    params = {"worker": worker_id, "limit": OFFER_BATCH, "since": since, "pending": pending}
    parts = []
    for kind in (JobKind.EVAL, JobKind.BUILD):
        how = offerable(worker, kind)
        if how is None:
            continue
        table, prefix = job_table(kind)
        fetch_only = how.steps_for.get(EvaluationStatus.QUEUED) == FETCH_STEPS
        part = UNOFFERED_SQL.format(
            table=table,
            prefix=prefix,
            kind=kind,
            statuses=f"{kind}_statuses",  # the kinds' statuses differ; the rest is shared
            member_filter="AND NOT j.active_member" if fetch_only else "",
            # Two texts, not one with an OR: a plan for both could use the index for neither.
            since_filter=WRITTEN_SINCE if since is not None else "true",
        )
        filter_params = job_filter_params(worker, how)
        params[f"{kind}_statuses"] = filter_params.pop("statuses")
        params.update(filter_params)
        parts.append(f"({part})")
    if not parts:
        return None
    with db_connection.cursor() as cursor:
        cursor.execute(OFFER_SQL.format(parts=" UNION ALL ".join(parts)), params)
        # The keys as one string: no JSON to parse, no array to load, for what this needs.
        xmin, jobs_json, keys, most_of_a_kind = cursor.fetchone()
    # An offer cut short at OFFER_BATCH (per kind) leaves rows to offer: the mark stays.
    if mark is not None and most_of_a_kind < OFFER_BATCH:
        if since is None:
            mark.full_read_at = time.monotonic()
        mark.xmin = xmin
    if mark is not None:
        mark.quiet = not keys
    if not keys:
        return None
    if mark is not None:
        mark.offered(keys.split(","))
    return RenderedOffer(jobs_json)


def written_since(mark: OfferMark, since: str) -> bool:
    """Whether a job row was written since the mark; if not, the mark moves on."""
    with db_connection.cursor() as cursor:
        cursor.execute(WRITTEN_SINCE_SQL, {"since": since})
        xmin, written = cursor.fetchone()
    if not written:
        mark.xmin = xmin
    return written


# A JobScores answer in one statement, no model instances: a fleet's scores are tens of
# thousands of rows.
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
    """Store a JobScores answer; scores for jobs never offered are kept too (harmless, and a
    worker may score ahead). One score per job: PostgreSQL refuses an upsert that touches
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
