from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.jobs.claim import Assignment, ClaimGate, claim_assignment
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from gradient.jobs.transitions import advance_build
from tests.factories import BuildFactory, WorkerFactory
from workers.liveness import disconnect_silent_workers
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
