from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.jobs.claim import Assignment, ClaimGate, claim_assignment
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from gradient.jobs.transitions import advance_build
from sessions.liveness import disconnect_silent_workers
from tests.factories import BuildFactory, WorkerFactory
from workers.models import IdleSlot, Worker


@pytest.mark.django_db
def test_a_silent_worker_is_disconnected_and_its_single_jobs_requeued(settings, memory_layer):
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    now = timezone.now()
    silent = WorkerFactory(channel_name="gone", last_seen_at=now - timedelta(seconds=121))
    alive = WorkerFactory(channel_name="here", last_seen_at=now - timedelta(seconds=30))
    build = BuildFactory()
    assert claim_assignment(
        Assignment(ClaimGate("build", build.pk), silent.pk, build.project_id, ["build"])
    )
    assert advance_build(build.pk, BuildStatus.BUILDING)
    IdleSlot.objects.create(worker=silent, kind="eval", recorded_at=now)

    assert disconnect_silent_workers(now) == [silent.pk]
    assert Worker.objects.get(pk=silent.pk).channel_name is None
    assert Worker.objects.get(pk=alive.pk).channel_name == "here"
    assert DispatchedJob.objects.get().outcome == "Abandoned"
    assert DerivationBuild.objects.get().status == BuildStatus.QUEUED
    assert not IdleSlot.objects.exists()
    assert disconnect_silent_workers(now) == []


@pytest.mark.django_db
def test_a_silent_workers_cluster_member_is_never_requeued_as_a_single_job(settings, memory_layer):
    """Members count as tracked while their attempt is open: the sweep does not abandon them
    as single jobs; their loss goes into the attempt's verdict instead."""
    from clusters import coordinator
    from clusters.dispatch import run_pass
    from clusters.models import ClusterAttempt
    from tests.clusterflow import idle_workers
    from tests.factories import BuildMemberFactory, ClusterFactory

    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    cluster = ClusterFactory(retry_budget=1)
    BuildMemberFactory(cluster_job=cluster, role="a")
    BuildMemberFactory(cluster_job=cluster, role="b")
    idle_workers(2)
    run_pass()
    rows = list(DispatchedJob.objects.all())
    for row in rows:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    silent = rows[0].worker
    Worker.objects.filter(pk=silent.pk).update(last_seen_at=timezone.now() - timedelta(600))

    assert disconnect_silent_workers() == [silent.pk]
    attempt = ClusterAttempt.objects.get()
    assert attempt.outcome == "Failed"  # decided by the verdict: a lost member, a retry
    cluster.refresh_from_db()
    assert cluster.status == "Queued"
    # Both builds went back through the verdict (Retry), not as single jobs.
    assert set(DerivationBuild.objects.values_list("status", flat=True)) == {BuildStatus.QUEUED}
    assert DispatchedJob.objects.get(pk=rows[0].pk).outcome == "Failed"
