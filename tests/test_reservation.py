"""Aging reservations on the real passes, with short settings."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from clusters.abort import abort_cluster
from clusters.book import startable_clusters
from clusters.dispatch import run_pass
from clusters.models import ClusterAttempt, ClusterJob, ClusterReservation
from clusters.reservation import active_reservation, due, first_target, note_waiting, reserve
from gradient.jobs.models import DerivationBuild, DispatchedJob
from sessions.request_job import answer_request
from tests.clusterflow import Inbox, committed, idle_workers
from tests.concurrency import rows_locked
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    WorkerFactory,
)
from workers.models import IdleSlot

pytestmark = committed


@pytest.fixture(autouse=True)
def no_wake(monkeypatch):
    # The single path as a session answers it (sessions.request_job), without the broker.
    monkeypatch.setattr("sessions.request_job.wake_dispatch", lambda: False)


@pytest.fixture(autouse=True)
def _short(settings, memory_layer):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "CLUSTER_RESERVE_AFTER_SECS": 60,
        "CLUSTER_RESERVE_TIMEOUT_SECS": 300,
    }


def cluster_aged(seconds, roles=("server", "client"), member=BuildMemberFactory):
    """A cluster the passes have seen able to start and unplaced for `seconds`."""
    cluster = ClusterFactory()
    for role in roles:
        member(cluster_job=cluster, role=role)
    ClusterJob.objects.filter(pk=cluster.pk).update(
        waiting_since=timezone.now() - timedelta(seconds=seconds)
    )
    return cluster


def waiting_since(cluster):
    return ClusterJob.objects.values_list("waiting_since", flat=True).get(pk=cluster.pk)


def busy_workers(n):
    return [WorkerFactory(channel_name="live", last_seen_at=timezone.now()) for _ in range(n)]


def test_a_young_cluster_reserves_nothing():
    cluster_aged(10)
    busy_workers(2)
    assert run_pass().reservation is None
    assert not ClusterReservation.objects.exists()


def test_the_clock_starts_when_a_pass_first_sees_the_cluster_able_to_start():
    cluster = cluster_aged(0)
    member = cluster.members.first()
    ClusterJob.objects.filter(pk=cluster.pk).update(
        created_at=timezone.now() - timedelta(hours=1), waiting_since=None
    )
    DerivationBuild.objects.filter(pk=member.derivation_build_id).update(status="Building")
    busy_workers(2)
    run_pass()  # a member cannot start: no clock, an hour old or not
    assert waiting_since(cluster) is None
    DerivationBuild.objects.filter(pk=member.derivation_build_id).update(status="Queued")
    before = timezone.now()
    assert run_pass().reservation is None  # its first pass able to start
    started = waiting_since(cluster)
    assert started >= before
    assert run_pass().reservation is None
    assert waiting_since(cluster) == started  # kept, not moved, while it waits
    ClusterJob.objects.filter(pk=cluster.pk).update(waiting_since=started - timedelta(seconds=61))
    assert run_pass().reservation == "reserved"


def test_the_clock_stops_when_the_cluster_is_placed_or_cannot_start():
    placed, held = cluster_aged(30), cluster_aged(30)
    idle_workers(2, kinds=("build",))
    run_pass()
    assert ClusterAttempt.objects.filter(cluster_job=placed).exists()
    assert waiting_since(placed) is None
    assert waiting_since(held) is not None
    member = held.members.first()
    DerivationBuild.objects.filter(pk=member.derivation_build_id).update(status="Building")
    run_pass()
    assert waiting_since(held) is None


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


def test_overdue_clusters_no_fleet_can_seat_cost_the_pass_one_read_of_the_fleet():
    # The older clusters need a feature no worker has: none of them has a target, and the
    # younger one reserves. Targets were computed one cluster at a time, each reading every
    # connected worker: a deep queue of such clusters cost one read of the fleet each.
    for _ in range(4):
        unseatable = cluster_aged(300)
        DerivationBuild.objects.filter(
            pk__in=unseatable.members.values("derivation_build_id")
        ).update(required_features=["gpu"])
    seatable = cluster_aged(120)
    busy_workers(2)
    with CaptureQueriesContext(connection) as queries:
        assert run_pass().reservation == "reserved"
    assert active_reservation().cluster_job_id == seatable.pk
    sql = [q["sql"] for q in queries]
    # The idle workers the pass plans over, then the fleet the targets are planned over.
    assert sum('FROM "worker"' in q or "FROM worker w" in q for q in sql) == 2
    # Scores are read for the cluster placed alone: the others lack a seat before that.
    assert sum('FROM "job_score"' in q for q in sql) == 1


def test_a_reserved_seat_gets_no_single_job_of_that_kind_until_released():
    cluster = cluster_aged(120)
    busy_workers(2)
    run_pass()
    reservation = active_reservation()
    seat = reservation.seats.first()
    BuildFactory()  # a single job that would fit
    assert answer_request(seat.worker_id, "build") is None
    assert IdleSlot.objects.filter(worker_id=seat.worker_id, kind="build").exists()
    abort_cluster(cluster.pk, "no longer wanted")  # the cluster leaves the queue
    assert run_pass().reservation == "released: the cluster left the queue"
    assert answer_request(seat.worker_id, "build") is not None


def test_only_one_cluster_holds_a_reservation():
    first, second = cluster_aged(300), cluster_aged(200, member=EvalMemberFactory)
    workers = busy_workers(4)
    assert run_pass().reservation == "reserved"  # the first only, though both are overdue
    assert active_reservation().cluster_job_id == first.pk
    [book_second] = [c for c in startable_clusters() if c.id == second.pk]
    placement = first_target([book_second], timezone.now())
    assert placement is not None
    assert reserve(placement) is None  # refused: the first holds one
    assert ClusterReservation.objects.count() == 1
    # The second (evaluations) plans over the workers left unreserved once they are idle.
    reserved = set(active_reservation().seats.values_list("worker_id", flat=True))
    free = [w for w in workers if w.pk not in reserved]
    now = timezone.now()
    for w in workers:  # every worker idle: only the unreserved ones are the second's to take
        IdleSlot.objects.create(worker=w, kind="eval", recorded_at=now)
    assert run_pass().claimed == [second.pk]
    attempt = ClusterAttempt.objects.get(cluster_job=second)
    assert set(attempt.dispatched_jobs.values_list("worker_id", flat=True)) == {w.pk for w in free}
    assert active_reservation().cluster_job_id == first.pk


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


def test_a_deleted_cluster_drops_its_reservation():
    cluster = cluster_aged(120)
    busy_workers(2)
    run_pass()
    seat = active_reservation().seats.first()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM cluster_job WHERE id = %s", [cluster.pk])
    assert active_reservation() is None
    assert not ClusterReservation.objects.exists()
    BuildFactory()
    assert answer_request(seat.worker_id, "build") is not None
    assert run_pass().reservation is None


def test_a_reservation_whose_members_changed_is_released():
    cluster = cluster_aged(120, roles=("server", "client", "client"))
    busy_workers(3)
    run_pass()
    # Evaluation garbage collection, or an operator, removes a member's job.
    DerivationBuild.objects.filter(pk=cluster.members.last().derivation_build_id).delete()
    assert run_pass().reservation == "released: the cluster's members changed"
    assert active_reservation() is None
    assert run_pass().reservation == "reserved"  # the next pass, on its members now
    assert active_reservation().seats.count() == 2


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
        assert answer_request(worker_id, "build") is not None


def test_after_a_timeout_other_clusters_reserve_first_and_the_clock_starts_again():
    first, second = cluster_aged(600), cluster_aged(120)
    busy_workers(2)
    run_pass()
    ClusterReservation.objects.update(created_at=timezone.now() - timedelta(seconds=301))
    released = timezone.now()
    run_pass()
    assert waiting_since(first) >= released
    assert run_pass().reservation == "reserved"
    assert active_reservation().cluster_job_id == second.pk
    ClusterReservation.objects.update(created_at=timezone.now() - timedelta(seconds=301))
    run_pass()
    assert run_pass().reservation is None  # both clocks restarted: nothing is overdue
    ClusterJob.objects.filter(pk=first.pk).update(
        waiting_since=timezone.now() - timedelta(seconds=61)
    )
    assert run_pass().reservation == "reserved"
    assert active_reservation().cluster_job_id == first.pk


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
    # An idle worker outside the reservation is the young cluster's, while the seats stay held.
    [free] = idle_workers(1, kinds=("eval",))
    assert run_pass().claimed == [young.pk]
    attempt = ClusterAttempt.objects.get(cluster_job=young)
    assert list(attempt.dispatched_jobs.values_list("worker_id", flat=True)) == [free.pk]
    assert old.pk == active_reservation().cluster_job_id


def test_the_clocks_skip_a_row_another_transaction_holds():
    held, free = cluster_aged(0), cluster_aged(0)
    ClusterJob.objects.update(waiting_since=None)
    with rows_locked(ClusterJob.objects.filter(pk=held.pk)):
        began = time.monotonic()
        note_waiting([held.pk, free.pk], timezone.now())
        assert time.monotonic() - began < 1  # did not wait for the holder
        assert waiting_since(held) is None and waiting_since(free) is not None
    note_waiting([held.pk, free.pk], timezone.now())  # the next pass catches up
    assert waiting_since(held) is not None


def test_a_single_claimed_while_a_reservation_commits_was_dispatched_before_its_stamp():
    # A claim cannot see a reservation before it commits. So the stamp that says "from here on
    # no single job" must come after the commit, or a seat's single claimed in between would
    # look given out while held. The reservation's commit here waits on a lock the test holds.
    cluster = cluster_aged(120)
    busy_workers(2)
    now = timezone.now()
    target = first_target(due(startable_clusters(now), set(), now), now)
    seat = target.seats[0]
    single = BuildFactory()
    gate = 7_400_001
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_hold_seats() RETURNS trigger LANGUAGE plpgsql AS"
            f" $$ BEGIN PERFORM pg_advisory_xact_lock({gate}); RETURN NULL; END $$;"
            " CREATE TRIGGER test_hold_seats AFTER INSERT ON reservation_seat"
            " FOR EACH STATEMENT EXECUTE FUNCTION test_hold_seats()"
        )
        cursor.execute("SELECT pg_advisory_lock(%s)", [gate])
    reserving = threading.Thread(target=lambda: (reserve(target), connection.close()))
    try:
        reserving.start()
        until_waiting_on(gate)
        # The reservation is written but not committed: the claim does not see it.
        claimed = answer_request(seat.worker.id, "build")
        assert claimed is not None and claimed.job_id == single.job_key
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [gate])
        reserving.join(30)
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER test_hold_seats ON reservation_seat; DROP FUNCTION test_hold_seats()"
            )
    reservation = active_reservation()
    assert reservation.cluster_job_id == cluster.pk
    dispatched = DispatchedJob.objects.get(job_id=single.job_key)
    assert dispatched.worker_id == seat.worker.id
    assert dispatched.dispatched_at < reservation.created_at
    # Once committed, the seat gets no single job.
    BuildFactory()
    assert answer_request(seat.worker.id, "build") is None


def until_waiting_on(lock_id, timeout=10):
    """Until another backend waits for the advisory lock."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                " AND objid = %s AND NOT granted)",
                [lock_id],
            )
            if cursor.fetchone()[0]:
                return
        time.sleep(0.01)
    raise AssertionError("no backend waited for the lock")
