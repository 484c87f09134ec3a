"""A quarantined worker seats no cluster member: not in a pass, not in a claim planned before the
quarantine, not in a reservation, not asked for its scores; explain_cluster says so; single jobs
still reach it."""

from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import planner
from clusters.claim import claim_cluster
from clusters.dispatch import run_pass
from clusters.explain import explain
from clusters.models import ClusterAttempt, ClusterJob
from clusters.reservation import active_reservation
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import committed, idle_workers, make_cluster, seated_claim_for
from tests.factories import BuildFactory, BuildMemberFactory, ClusterFactory, WorkerFactory
from tests.planning import cluster as planned_cluster
from tests.planning import member, snapshot, worker
from workers import health
from workers.assignment import request_job
from workers.models import IdleSlot, JobScore

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _layer(memory_layer, settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_RESERVE_AFTER_SECS": 60}


def seated(cluster) -> set[int]:
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    return set(attempt.dispatched_jobs.values_list("worker_id", flat=True))


def test_the_planner_gives_quarantined_as_the_reason_and_never_seats_it():
    sick = replace(worker(1), quarantined=True)
    well = worker(2)
    m = member("a")
    assert planner.seat_reason(m, sick) == "quarantined"
    assert planner.seat_reason(m, well) is None
    # Cheaper by far, but quarantined: the member sits on the healthy worker.
    snap = snapshot([planned_cluster(m)], [sick, well], {(1, "build:a"): 0, (2, "build:a"): 9})
    [placement] = planner.plan(snap)
    assert [s.worker.id for s in placement.seats] == [2]
    only_sick = snapshot([planned_cluster(m)], [sick])
    assert planner.plan(only_sick) == []


@committed
def test_a_pass_seats_the_members_on_the_healthy_workers_only():
    sick, *_ = idle_workers(3)
    health.quarantine(sick, "flaky")
    cluster = make_cluster()
    assert run_pass().claimed == [cluster.pk]
    assert sick.pk not in seated(cluster)


@committed
def test_a_cluster_waits_rather_than_sit_on_a_quarantined_worker():
    sick, well = idle_workers(2)
    health.quarantine(sick, None)
    cluster = make_cluster()
    assert run_pass().claimed == []
    out = explain(cluster.pk)
    reasons = {o["worker"]: o["reason"] for m in out["members"] for o in m["others"]}
    assert reasons[sick.name] == "quarantined"
    assert "compete for 1 worker" in out["summary"]
    health.release(sick)
    assert run_pass().claimed == [cluster.pk]
    assert seated(cluster) == {sick.pk, well.pk}


def test_a_claim_refuses_a_seat_whose_worker_was_quarantined_after_the_snapshot():
    # The planner read the worker healthy; the operator quarantined it before the claim.
    cluster = make_cluster()
    sick, well = WorkerFactory.create_batch(2)
    claim = seated_claim_for(cluster, [sick, well], timezone.now() - timedelta(seconds=1))
    health.quarantine(sick, "flaky")
    assert not claim_cluster(claim)
    assert not ClusterAttempt.objects.exists() and not DispatchedJob.objects.exists()
    assert IdleSlot.objects.filter(worker__in=[sick, well]).count() == 2  # both left idle
    health.release(sick)
    assert claim_cluster(claim)


@committed
def test_a_lapsed_automatic_quarantine_seats_members_again():
    sick, _ = idle_workers(2)
    now = timezone.now()
    sick.__class__.objects.filter(pk=sick.pk).update(
        quarantined_by="automatic",
        quarantined_since=now - timedelta(seconds=20),
        quarantined_until=now - timedelta(seconds=1),
    )
    cluster = make_cluster()
    assert run_pass().claimed == [cluster.pk]
    assert sick.pk in seated(cluster)


def test_a_quarantined_worker_still_gets_single_jobs():
    sick = WorkerFactory(channel_name="live", last_seen_at=timezone.now())
    health.quarantine(sick, "flaky")
    job = BuildFactory()
    assign = request_job(sick.pk, "build").assign
    assert assign is not None and assign.job_id == job.job_key
    assert DispatchedJob.objects.get(job_id=job.job_key).worker_id == sick.pk


def overdue_cluster():
    """A cluster of two builds waiting past GRADIENT_CLUSTER_RESERVE_AFTER_SECS."""
    cluster = ClusterFactory()
    for role in ("server", "client"):
        BuildMemberFactory(cluster_job=cluster, role=role)
    ClusterJob.objects.filter(pk=cluster.pk).update(
        waiting_since=timezone.now() - timedelta(seconds=120)
    )


@committed
def test_a_reservation_never_takes_a_quarantined_worker():
    overdue_cluster()
    busy = [WorkerFactory(channel_name="live", last_seen_at=timezone.now()) for _ in range(3)]
    health.quarantine(busy[0], "flaky")
    assert run_pass().reservation == "reserved"
    seats = set(active_reservation().seats.values_list("worker_id", flat=True))
    assert seats == {busy[1].pk, busy[2].pk}


@committed
def test_a_reservation_whose_seat_is_quarantined_is_released():
    overdue_cluster()
    busy = [WorkerFactory(channel_name="live", last_seen_at=timezone.now()) for _ in range(2)]
    assert run_pass().reservation == "reserved"
    health.quarantine(busy[0], "flaky")
    assert run_pass().reservation == "released: a seat's worker was quarantined"


@committed
def test_the_pass_does_not_ask_a_quarantined_worker_for_its_scores(settings):
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 60_000}
    sick, *_ = idle_workers(3)
    health.quarantine(sick, "flaky")
    cluster = make_cluster()
    run_pass()
    keys = [m.job_key for m in cluster.members.all()]
    asked = set(JobScore.objects.filter(job_id__in=keys).values_list("worker_id", flat=True))
    assert asked and sick.pk not in asked
