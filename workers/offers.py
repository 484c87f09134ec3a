"""JobOffer and JobScores: the head of the queue offered to a worker, and what it would fetch.

A worker is offered, before a RequestJob is answered, the jobs of its head it was not offered
on this connection (workers.head, clusters.head.member_head_parts). Single jobs and members
are remembered apart, by who reads their scores:
- a single job's score serves only this worker's next choice on this connection, so the
  session keeps the offers and the scores (`Offered`), for the jobs at its head alone;
- a member's score serves the dispatch pass, so it is a job_score row: written when the job
  is offered, without a score, filled in by the answer, and deleted once the job left the
  worker's head. A worker's rows are its offers on this connection (attach deletes them), so
  a member is offered once per connection whichever process offers it.
"""

import json
import uuid
from collections.abc import Iterable
from datetime import timedelta

from django.db import connection as db_connection
from django.utils import timezone

from gradient.jobs.models import JobKind
from gradient.postgresql.arrays import int_array, text_array
from gradient.postgresql.pipeline import send
from gradient.wire.protocol import JobOffer, OfferedJob, Rendered
from workers import statements
from workers.head import HeadJob, offerable, platform_params, singles_sql
from workers.models import Worker

OFFER_GRACE = timedelta(seconds=10)


class RenderedOffer(Rendered):
    """A JobOffer of the jobs' JSON array, as PostgreSQL and the session render it."""

    model = JobOffer

    def __init__(self, jobs_json: str):
        super().__init__('{"type":"JobOffer","jobs":' + jobs_json + "}")

    @property
    def jobs(self) -> list[OfferedJob]:
        return self.message.jobs


class Offered:
    """A session's offers of the single jobs at its worker's head, with the worker's scores of
    them (a missing_nar_size, None until answered), for as long as each job stays at the head."""

    def __init__(self):
        self.sizes: dict[str, int | None] = {}

    def fresh(self, head: list[HeadJob], kinds=JobKind.values) -> list[HeadJob]:
        """The jobs of the head (of these kinds) not offered yet, now counted as offered; the
        others of those kinds forgotten."""
        at_head = {job.key for job in head}
        read = tuple(f"{kind}:" for kind in kinds)
        self.sizes = {
            key: size
            for key, size in self.sizes.items()
            if key in at_head or not key.startswith(read)
        }
        new = [job for job in head if job.key not in self.sizes]
        self.sizes.update((job.key, None) for job in new)
        return new

    def record(self, scores: Iterable) -> list:
        """Keep the scores of the single jobs offered; the others (members) are returned."""
        rest = []
        for score in scores:
            if score.job_id in self.sizes:
                self.sizes[score.job_id] = score.missing_nar_size
            else:
                rest.append(score)
        return rest


class Head:
    """What one offer read: the single jobs at the head per kind, and the JobOffer, if any."""

    def __init__(self, singles: list[HeadJob], offer: RenderedOffer | None):
        self.offer = offer
        self.singles: dict[str, list[HeadJob]] = {kind: [] for kind in JobKind.values}
        for job in singles:
            self.singles[job.kind].append(job)


def singles_parts(worker: Worker, kinds=JobKind.values) -> list[str]:
    """The single jobs' part of each kind's head this worker can serve."""
    archs = len(worker.architectures)
    return [singles_sql(how, archs) for kind in kinds if (how := offerable(worker, kind))]


def offer_head(
    worker: Worker, offered: Offered | None = None, member_parts=(), kinds=JobKind.values
) -> Head:
    """Read the worker's head of these kinds and offer it the jobs it has not been offered on
    this connection (`offered` remembers the single jobs; without it, every single job counts
    as new). `member_parts` are the members' parts of those kinds
    (clusters.head.member_head_parts)."""
    offered = offered if offered is not None else Offered()
    if worker.draining:
        return Head([], None)
    singles = [f"({part})" for part in singles_parts(worker, kinds)] or [statements.NO_SINGLES]
    members = list(member_parts) or [statements.NO_MEMBERS]
    sql = statements.HEAD_OFFER_SQL.format(
        singles=" UNION ALL ".join(singles),
        members=" UNION ".join(f"({part})" for part in members),
    )
    now = timezone.now()
    params = {"now": now, "grace_since": now - OFFER_GRACE, "kinds": list(kinds)}
    # Both in one round trip: the statements of a pipeline up to its sync are one transaction,
    # even outside a transaction block, so the setting holds for the offer alone.
    db_connection.ensure_connection()
    with db_connection.wrap_database_errors, db_connection.connection.pipeline():
        send(statements.GENERIC_PLAN_SQL)
        cursor = send(sql, {**platform_params(worker), **params})
    singles_json, members_json = cursor.fetchone()
    head = [_head_job(row) for row in json.loads(singles_json)]
    new = [job.offered() for job in offered.fresh(head, kinds)]
    items = ([json.dumps(new)[1:-1]] if new else []) + (
        [members_json[1:-1]] if members_json != "[]" else []
    )
    return Head(head, RenderedOffer("[" + ",".join(items) + "]") if items else None)


def _head_job(row: list) -> HeadJob:
    job = HeadJob._make(row)
    return job._replace(id=uuid.UUID(job.id))


def record_scores(worker_id: int, scores) -> int:
    """Store the scores of members (or of keys not offered as single jobs: the next offer
    deletes those unless the job is at the worker's head). One score per job: PostgreSQL
    refuses an upsert that touches one row twice."""
    if not scores:
        return 0
    with db_connection.cursor() as cursor:
        cursor.execute(
            statements.RECORD_SCORES_SQL,
            {
                "worker": worker_id,
                "now": timezone.now(),
                "jobs": text_array([s.job_id for s in scores]),
                "counts": int_array(s.missing_count for s in scores),
                "sizes": int_array(s.missing_nar_size for s in scores),
            },
        )
    return len(scores)
