"""The single path: RequestJob -> the cheapest job of the worker's head -> claim -> AssignJob.
Cluster members start only through their cluster; nothing to give records an idle slot."""

import functools
import uuid
from collections.abc import Mapping
from typing import NamedTuple

from django.db import connection, transaction
from django.utils import timezone
from pydantic_core import to_json

from gradient.jobs.claim import Assignment, ClaimGate, claim_params
from gradient.jobs.models import (
    JOB_MACHINES,
    BuildStatus,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.statements import claim_sql
from gradient.jobs.work import NO_WORK
from gradient.postgresql.pipeline import send
from gradient.wire.keys import job_key_sql
from gradient.wire.protocol import AssignJob, Rendered
from workers import statements
from workers.head import (
    HeadJob,
    Offerable,
    job_table,
    literals,
    offerable,
    read_singles,
    window,
)
from workers.models import IdleSlot, Worker, idle_slot_fresh_since

HEAD_READS = 3  # rivals took every job of the head read: read it again, then give up


def ranked(head: list[HeadJob], sizes: Mapping[str, int | None]) -> list[HeadJob]:
    """The head's single jobs in the order the single path gives them: prioritized first; one
    passed over by a window of younger jobs while first in line; the least to fetch (a job
    never scored is the most expensive); the older (the head comes oldest first)."""
    overdue = window()

    def order(item):
        position, job = item
        size = sizes.get(job.key)
        return (not job.prioritized, job.passed_over < overdue, size is None, size or 0, position)

    return [job for _, job in sorted(enumerate(head), key=order)]


@functools.cache
def _claim_sql(kind: str, statuses: tuple[str, ...], skip: bool, reserved: str) -> str:
    return statements.SINGLE_CLAIM_SQL.format(
        table=job_table(kind),
        kind=kind,
        reserved=reserved,
        statuses=literals(statuses),
        has_room=statements.has_room_sql(f"'{kind}'"),
        claim=claim_sql(
            statements.PICKED.format(picked=job_key_sql(kind, "(SELECT id FROM pick)"))
        ),
        assigned=JOB_MACHINES[kind].update(
            "assigned", "id = (SELECT id FROM pick) AND EXISTS (SELECT 1 FROM claimed)"
        ),
        skip="SKIP LOCKED" if skip else "",
    )


def _assigned(how: Offerable) -> dict:
    """The Assigned transition of a job claimed this way: a build goes Building; an evaluation
    Fetching for a fetch-only worker, else EvaluatingFlake."""
    if how.kind == JobKind.BUILD:
        to = BuildStatus.BUILDING
    else:
        to = EvaluationStatus.FETCHING if how.fetch_only else EvaluationStatus.EVALUATING_FLAKE
    return JOB_MACHINES[how.kind].bind("assigned", to, how.statuses)


class Claimed(NamedTuple):
    job: HeadJob | None  # the job claimed, None if none
    assignment: uuid.UUID | None
    steps: list[str]
    no_room: bool  # full or draining
    reserved: bool
    work: dict | None = None  # what the job claimed runs (CLAIMED_WORK)


NOTHING = Claimed(None, None, [], False, False)


def claim_best(
    worker: Worker, how: Offerable, jobs: list[HeadJob], first: HeadJob, reserved: str
) -> Claimed:
    """Claim the first of `jobs` (ranked) that can be claimed."""
    by_id = {job.id: job for job in jobs}
    skip = True
    while by_id:
        rows = {job.key: _assignment(worker, how, job) for job in by_id.values()}
        with connection.cursor() as cursor:
            cursor.execute(
                _claim_sql(how.kind, how.statuses, skip, reserved),
                {
                    "ids": list(by_id),
                    "worker": worker.pk,
                    "first": first.id,
                    **_assigned(how),
                    **claim_params(list(rows.values())),
                },
            )
            picked, claimed, no_room, reserved, work = cursor.fetchone()
        if no_room or reserved:
            return NOTHING._replace(no_room=no_room, reserved=reserved)
        if picked is None:
            if not skip:
                break
            skip = False  # every one locked: wait for the best, a lock may be a moment's
            continue
        job = by_id.pop(picked)
        if claimed is not None:
            assignment = rows[claimed]
            return Claimed(job, assignment.id, assignment.steps, False, False, work)
    return NOTHING


def _assignment(worker: Worker, how: Offerable, job: HeadJob) -> Assignment:
    return Assignment(
        gate=ClaimGate(how.kind, job.id, job.substitute),
        worker_id=worker.pk,
        project_id=job.project_id,
        steps=how.steps_for[job.status],
    )


def record_idle(worker_id: int, kind: str, resend: bool = False) -> bool:
    """Record the slot; with `resend`, refresh it if it is still there. False only for a slot
    refreshed while the planner still trusted it: no pass needs waking for it."""
    now = timezone.now()
    params = {"worker": worker_id, "kind": kind, "now": now}
    if resend:
        with connection.cursor() as cursor:
            cursor.execute(statements.REFRESH_IDLE_SQL, params)
            replaced = cursor.fetchone()
        if replaced is not None:
            return replaced[0] < idle_slot_fresh_since(now)
    # The atomic block opens the connection before the pipeline is asked of it.
    with transaction.atomic(), connection.wrap_database_errors, connection.connection.pipeline():
        send(statements.LOCK_IDLE_SQL, params)
        send(statements.RECORD_IDLE_SQL, params)
    return True


def clear_idle(worker_id: int, kind: str | None = None) -> None:
    slots = IdleSlot.objects.filter(worker_id=worker_id)
    if kind is not None:
        slots = slots.filter(kind=kind)
    slots.delete()


class RenderedAssign(Rendered):
    """An AssignJob as its frame, with the one field a session reads (`job_id`)."""

    model = AssignJob

    def __init__(self, job_id: str, text: str):
        super().__init__(text)
        self.job_id = job_id


class Answer(NamedTuple):
    assign: RenderedAssign | None
    wake: bool  # an idle slot was recorded that no pass has seen: a placement may complete


def request_job(
    worker_id: int,
    kind: str,
    worker: Worker | None = None,
    head: list[HeadJob] | None = None,
    sizes: Mapping[str, int | None] | None = None,
    resend: bool = False,
    reserved: str = "false",
) -> Answer:
    """Answer a RequestJob: an AssignJob for the best single job of the worker's head it can take
    now, or none after recording an idle slot. `head` and `sizes` are the kind's head as offered
    and the worker's scores of it (read now when None). `resend`: the last answer for this kind was
    an idle slot. `reserved`: SQL, whether worker w holds a seat of this kind for a cluster (from
    the clusters app, whose tables this app does not read)."""
    worker = worker or Worker.objects.get(pk=worker_id)
    how = offerable(worker, kind)
    if how is None or worker.draining:
        clear_idle(worker_id, kind)
        return Answer(None, False)
    for read in range(HEAD_READS):
        jobs = head if read == 0 and head is not None else read_singles(worker, how)
        if not jobs:
            break
        claimed = claim_best(worker, how, ranked(jobs, sizes or {}), jobs[0], reserved)
        if claimed.no_room:
            clear_idle(worker_id, kind)
            return Answer(None, False)
        if claimed.reserved:
            # A reserved seat: no new single job of this kind, and its idle slot is what lets
            # the reservation commit.
            break
        if claimed.job is not None:
            return Answer(assign_frame(claimed), False)
    return Answer(None, record_idle(worker_id, kind, resend))


def assign_job(
    key: str,
    assignment_id,
    kind: str,
    job_id,
    project: str,
    architecture: str,
    features,
    steps: list[str],
    cluster: dict | None = None,
    work: Mapping | None = None,
) -> RenderedAssign:
    """The AssignJob of a claimed job, a single's or (with its hold) a member's, rendered from the
    rows by pydantic's serializer without building the models, which would cost a large pass most
    of its time. `work` is what its claim read (CLAIMED_WORK)."""
    job = str(job_id)
    work = work or NO_WORK
    body = {
        "type": "AssignJob",
        "job_id": key,
        "assignment_id": str(assignment_id),
        "job": {
            "kind": kind,
            "project": project,
            "evaluation": job if kind == JobKind.EVAL else None,
            "build": job if kind == JobKind.BUILD else None,
            "architecture": architecture,
            "required_features": list(features),
            "steps": steps,
            "command": work["command"],
            "env": work["env"],
            "timeout_secs": work["timeout_secs"],
        },
        "cluster": cluster,
    }
    return RenderedAssign(key, to_json(body).decode())


def assign_frame(claimed: Claimed) -> RenderedAssign:
    job = claimed.job
    return assign_job(
        job.key,
        claimed.assignment,
        job.kind,
        job.id,
        job.project,
        job.architecture,
        job.required_features,
        claimed.steps,
        work=claimed.work,
    )
