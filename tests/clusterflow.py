"""Shared set-up for cluster-flow tests: connected workers with idle slots, frames captured
from the channel layer, clusters and their claims."""

import time

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.utils import timezone

from clusters.claim import ClusterClaim, claim_cluster
from clusters.coordinator import accept_assignment
from clusters.models import ClusterAttempt
from gradient.jobs.claim import Assignment, ClaimGate, claim_params
from gradient.jobs.models import DispatchedJob
from gradient.jobs.statements import claim_sql
from gradient.wire.groups import drain_sends, worker_group
from sessions.request_job import answer_request, read_and_answer
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot
from workers.offers import Offered

# The dispatch pass reads scores and claims on threads with database connections of their own,
# which see committed rows only: a test that runs a pass commits its rows.
committed = pytest.mark.django_db(transaction=True)


def idle_workers(n, kinds=("eval", "build"), **fields):
    now = timezone.now()
    workers = []
    for _ in range(n):
        worker = WorkerFactory(channel_name="live", last_seen_at=now, **fields)
        for kind in kinds:
            IdleSlot.objects.create(worker=worker, kind=kind, recorded_at=now)
        workers.append(worker)
    return workers


def claim_assignment(assignment: Assignment) -> bool:
    """One row through the claim statement every claim runs, with no condition of a caller's:
    whether it won."""
    with connection.cursor() as cursor:
        cursor.execute(claim_sql("true"), claim_params([assignment]))
        return cursor.fetchone() is not None


def session_request(worker, kind, offered=None):
    """A RequestJob answered as a session answers it, without the wait for the worker's
    scores: the head's JobOffer (or None) and the AssignJob (or None)."""
    offered = offered if offered is not None else Offered()
    head, answered, assign = read_and_answer(worker, offered, kind)
    if not answered:
        assign = answer_request(worker.pk, kind, worker, head.singles[kind], dict(offered.sizes))
    return head.offer, assign


class Inbox:
    """Listens on the groups of some workers, as their sessions would."""

    def __init__(self, workers):
        self.layer = get_channel_layer()
        self.channels = {}
        for w in workers:
            channel = async_to_sync(self.layer.new_channel)()
            async_to_sync(self.layer.group_add)(worker_group(w.pk), channel)
            self.channels[w.pk] = channel

    def frames(self, worker) -> list[dict]:
        """The frames sent to the worker so far, once the sends not waited for are done (a
        dispatch pass's)."""
        import json

        drain_sends()
        out = []
        while True:
            try:
                message = async_to_sync(self._receive)(self.channels[worker.pk])
            except TimeoutError:
                return out
            out.append(json.loads(message["frame"]))

    async def _receive(self, channel):
        import asyncio

        return await asyncio.wait_for(self.layer.receive(channel), 0.05)


def accept_every_member(attempt_id) -> list:
    """Each member of the attempt accepts its assignment, in row order, as its worker would
    (coordinator.accept_assignment): the last acceptance starts the attempt. What each
    returned: True for the one that started it."""
    rows = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).order_by("id")
    return [accept_assignment(r.worker_id, r.job_id) for r in rows]


# Clusters of a server (an evaluation) and a client (a build), and claims of them.


def make_cluster(**kwargs):
    cluster = ClusterFactory(**kwargs)
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    return cluster


def claim_for(cluster, workers, reverse=False):
    members = list(cluster.members.order_by("id"))
    if reverse:
        members.reverse()
    return ClusterClaim(
        cluster_id=cluster.pk,
        members=[
            Assignment(
                gate=ClaimGate(m.kind, m.evaluation_id or m.derivation_build_id),
                worker_id=w.pk,
                project_id=cluster.project_id,
            )
            for m, w in zip(members, workers, strict=False)
        ],
    )


def seated_claim_for(cluster, workers, since):
    """claim_for, taking each worker's idle slot of its member's kind (as the dispatch pass
    does)."""
    claim = claim_for(cluster, workers)
    claim.idle_seats = [(m.worker_id, m.gate.kind) for m in claim.members]
    claim.idle_since = since
    for worker_id, kind in claim.idle_seats:
        IdleSlot.objects.update_or_create(
            worker_id=worker_id, kind=kind, defaults={"recorded_at": timezone.now()}
        )
    return claim


def claimed(cluster) -> ClusterClaim:
    """A won claim of the cluster, on fresh workers."""
    claim = claim_for(cluster, WorkerFactory.create_batch(2))
    assert claim_cluster(claim)
    return claim


def open_rows(cluster):
    keys = [m.job_key for m in cluster.members.all()]
    return DispatchedJob.objects.filter(job_id__in=keys, finished_at__isnull=True)


def assert_whole_or_nothing(cluster):
    """Either one open attempt owning an open row for every member, or neither."""
    attempts = list(ClusterAttempt.objects.filter(cluster_job=cluster, finished_at__isnull=True))
    rows = list(open_rows(cluster).filter(cluster_attempt__isnull=False))
    if attempts:
        assert len(attempts) == 1
        assert {r.cluster_attempt_id for r in rows} == {attempts[0].pk}
        assert len(rows) == cluster.members.count()
    else:
        assert rows == []


def hold_open_row(conn, member, project_id) -> None:
    """An open row of the member's job, inserted on `conn` (a frozen_connection) and left
    uncommitted: a claim of the job waits on it until `conn` commits or rolls back."""
    conn.execute(
        "INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, derivation_build_id,"
        " worker_id, project_id, steps, dispatched_at)"
        " VALUES (gen_random_uuid(), %s, %s, %s, %s, %s, %s, '{}', now())",
        [
            member.kind,
            member.job_key,
            member.evaluation_id,
            member.derivation_build_id,
            WorkerFactory().pk,
            project_id,
        ],
    )


def wait_for_lock_waits(n, timeout=10.0) -> bool:
    """Whether n transactions of this database are waiting on a lock, within the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0] >= n:
                return True
        time.sleep(0.002)
    return False
