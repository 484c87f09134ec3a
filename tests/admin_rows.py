"""Rows the admin tests read back through the admin, and how a list page is read."""

from datetime import timedelta

from django.urls import reverse
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob, DispatchedOutcome, JobKind
from tests.factories import (
    BuildMemberFactory,
    EvalMemberFactory,
    ProjectFactory,
    WorkerFactory,
)

CLUSTERS = reverse("admin:clusters_clusterjob_changelist")


def attempt(cluster, outcome, minutes_ago):
    at = timezone.now() - timedelta(minutes=minutes_ago)
    return ClusterAttempt.objects.create(
        cluster_job=cluster, created_at=at, started_at=at, finished_at=at, outcome=outcome
    )


def dispatched(worker, cluster_attempt=None):
    project = ProjectFactory()
    return DispatchedJob.objects.create(
        kind=JobKind.EVAL,
        job_id="eval:00000000-0000-0000-0000-000000000001",
        worker=worker,
        project=project,
        dispatched_at=timezone.now(),
        cluster_attempt=cluster_attempt,
    )


def listed(client, url, **params):
    response = client.get(url, params)
    assert response.status_code == 200
    return set(response.context["cl"].result_list)


def seat(cluster_attempt, member, worker, outcome=None):
    return DispatchedJob.objects.create(
        kind=member.kind,
        job_id=member.job_key,
        worker=worker,
        project=member.cluster_job.project,
        dispatched_at=cluster_attempt.created_at,
        finished_at=cluster_attempt.finished_at,
        outcome=outcome,
        cluster_attempt=cluster_attempt,
    )


def two_attempts():
    """A cluster that failed its prepare once on zone a, then succeeded on zone b."""
    server = EvalMemberFactory(role="server", primary=True)
    cluster = server.cluster_job
    client = BuildMemberFactory(cluster_job=cluster, role="client")
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.COMPLETED, attempts=1)
    t0 = timezone.now() - timedelta(minutes=30)
    failed = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0,
        finished_at=t0 + timedelta(seconds=30),
        outcome=AttemptOutcome.PREPARE_FAILED,
    )
    done = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0 + timedelta(minutes=1),
        started_at=t0 + timedelta(minutes=2),
        finished_at=t0 + timedelta(minutes=20),
        outcome=AttemptOutcome.SUCCEEDED,
    )
    a1, a2 = WorkerFactory(name="a1", zone="a"), WorkerFactory(name="a2", zone="a")
    b1, b2 = WorkerFactory(name="b1", zone="b"), WorkerFactory(name="b2", zone=None)
    seat(failed, server, a1, DispatchedOutcome.ABANDONED)
    seat(failed, client, a2, DispatchedOutcome.FAILED)
    seat(done, server, b1, DispatchedOutcome.COMPLETED)
    seat(done, client, b2, DispatchedOutcome.COMPLETED)
    return cluster, failed, done
