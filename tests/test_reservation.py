"""Aging reservations on the real passes, with short settings."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.abort import abort_cluster
from clusters.dispatch import run_pass
from clusters.models import ClusterAttempt, ClusterJob, ClusterReservation
from clusters.reservation import active_reservation, reserve, target
from clusters.tracking import startable_clusters
from tests.clusterflow import Inbox, idle_workers
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    WorkerFactory,
)
from workers.assignment import request_job
from workers.models import IdleSlot

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _short(settings, memory_layer):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "CLUSTER_RESERVE_AFTER_SECS": 60,
        "CLUSTER_RESERVE_TIMEOUT_SECS": 300,
    }


def cluster_aged(seconds, roles=("server", "client")):
    cluster = ClusterFactory()
    for role in roles:
        BuildMemberFactory(cluster_job=cluster, role=role)
    ClusterJob.objects.filter(pk=cluster.pk).update(
        created_at=timezone.now() - timedelta(seconds=seconds)
    )
    return cluster


def busy_workers(n):
    return [WorkerFactory(channel_name="live", last_seen_at=timezone.now()) for _ in range(n)]


def test_a_young_cluster_reserves_nothing():
    cluster_aged(10)
    busy_workers(2)
    assert run_pass().reservation is None
    assert not ClusterReservation.objects.exists()


def test_an_old_cluster_reserves_idle_workers_first():
    cluster = cluster_aged(120)
    idle = idle_workers(1, kinds=("build",))[0]
    busy = busy_workers(3)
    assert run_pass().reservation == "reserved"
    reservation = active_reservation()
    assert reservation.cluster_job_id == cluster.pk
    seated = set(reservation.seats.values_list("worker_id", flat=True))
    assert idle.pk in seated and len(seated) == 2
    assert len(seated & {w.pk for w in busy}) == 1
    assert not ClusterAttempt.objects.exists()  # not every seat is idle yet


def test_a_reserved_seat_gets_no_single_job_of_that_kind_until_released():
    cluster = cluster_aged(120)
    busy_workers(2)
    run_pass()
    reservation = active_reservation()
    seat = reservation.seats.first()
    BuildFactory()  # a single job that would fit
    assert request_job(seat.worker_id, "build") is None
    assert IdleSlot.objects.filter(worker_id=seat.worker_id, kind="build").exists()
    abort_cluster(cluster.pk, "no longer wanted")  # the cluster leaves the queue
    assert run_pass().reservation == "released: the cluster left the queue"
    assert request_job(seat.worker_id, "build") is not None


def test_only_one_cluster_holds_a_reservation():
    first, second = cluster_aged(300), cluster_aged(200)
    busy_workers(4)
    run_pass()
    assert active_reservation().cluster_job_id == first.pk
    [book_second] = [c for c in startable_clusters() if c.id == second.pk]
    placement = target(book_second, timezone.now())
    assert placement is not None
    assert reserve(placement, timezone.now()) is None
    assert ClusterReservation.objects.count() == 1


def test_a_disconnected_seat_drops_the_reservation_and_the_next_pass_reserves_again():
    cluster_aged(120)
    busy_workers(3)
    run_pass()
    reservation = active_reservation()
    gone = reservation.seats.first().worker
    gone.channel_name = None
    gone.save()
    assert run_pass().reservation == "released: a seat's worker disconnected"
    assert active_reservation() is None
    assert run_pass().reservation == "reserved"
    reservation.refresh_from_db()
    assert reservation.release_reason == "a seat's worker disconnected"
    again = active_reservation()
    assert gone.pk not in set(again.seats.values_list("worker_id", flat=True))


def test_a_cluster_leaving_the_queue_drops_its_reservation():
    cluster = cluster_aged(120)
    busy_workers(2)
    run_pass()
    ClusterJob.objects.filter(pk=cluster.pk).update(status="Aborted")
    run_pass()
    reservation = ClusterReservation.objects.get()
    assert reservation.release_reason == "the cluster left the queue"


def test_a_timed_out_reservation_frees_its_seats_for_single_jobs():
    cluster_aged(120)
    busy_workers(2)
    run_pass()
    seats = list(active_reservation().seats.values_list("worker_id", flat=True))
    ClusterReservation.objects.update(created_at=timezone.now() - timedelta(seconds=301))
    # The pass that releases it does not reserve again, on these seats or any.
    assert run_pass().reservation == "released: timed out"
    assert ClusterReservation.objects.get().release_reason == "timed out"
    assert active_reservation() is None
    # Before any new reservation, the freed seats take single jobs.
    for worker_id in seats:
        BuildFactory()
        assert request_job(worker_id, "build") is not None


def test_a_reservation_commits_once_every_seat_is_idle():
    cluster = cluster_aged(120)
    workers = busy_workers(2)
    inbox = Inbox(workers)
    run_pass()
    reservation = active_reservation()
    now = timezone.now()
    seats = list(reservation.seats.all())
    IdleSlot.objects.create(worker_id=seats[0].worker_id, kind=seats[0].kind, recorded_at=now)
    assert run_pass().reservation == "holding"
    IdleSlot.objects.create(worker_id=seats[1].worker_id, kind=seats[1].kind, recorded_at=now)
    assert run_pass().reservation == "committed"
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert set(attempt.dispatched_jobs.values_list("worker_id", flat=True)) == {
        s.worker_id for s in seats
    }
    reservation.refresh_from_db()
    assert reservation.release_reason == "committed"
    assert sum(len(inbox.frames(w)) for w in workers) == 2


def test_other_clusters_plan_over_the_unreserved_idle_workers():
    old = cluster_aged(120)
    busy_workers(2)
    run_pass()
    reserved = set(active_reservation().seats.values_list("worker_id", flat=True))
    # The reserved workers go idle, but a younger cluster may not take them.
    young = ClusterFactory()
    EvalMemberFactory(cluster_job=young)
    now = timezone.now()
    for worker_id in reserved:
        IdleSlot.objects.create(worker_id=worker_id, kind="eval", recorded_at=now)
    run_pass()
    assert not ClusterAttempt.objects.filter(cluster_job=young).exists()
    assert old.pk == active_reservation().cluster_job_id
