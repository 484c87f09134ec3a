"""Tracking, the dispatch pass, and the prepare-and-start handshake, on the real database with
the in-memory channel layer standing in for the sessions."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import coordinator
from clusters.book import startable_clusters
from clusters.dispatch import claim_placements, run_pass
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterReservation, ClusterStatus
from clusters.settlement import member_report
from clusters.wake import WAKE_KEY, _client, clusters_waiting, wake_dispatch
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from gradient.wire.protocol import MemberRef
from tests.clusterflow import Inbox, committed, idle_workers
from tests.concurrency import race
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory
from workers.assignment import record_idle
from workers.models import IdleSlot, Worker

pytestmark = committed


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


def two_member_cluster(**kwargs):
    cluster = ClusterFactory(**kwargs)
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    return cluster


@pytest.mark.django_db
def test_a_queued_cluster_whose_members_can_start_is_in_the_book():
    ready = two_member_cluster()
    held_back = two_member_cluster()
    build = held_back.members.get(role="client").derivation_build
    build.status = BuildStatus.CREATED  # waiting for its dependencies
    build.save()
    assert [c.id for c in startable_clusters()] == [ready.pk]
    members = startable_clusters()[0].members
    assert sorted((m.role, m.index, m.kind) for m in members) == [
        ("client", 0, "build"),
        ("server", 0, "eval"),
    ]


@pytest.mark.django_db
def test_prioritized_clusters_come_first_then_the_oldest():
    old, new = two_member_cluster(), two_member_cluster()
    urgent = two_member_cluster()
    urgent.prioritized = True
    urgent.save()
    assert [c.id for c in startable_clusters()] == [urgent.pk, old.pk, new.pk]


def test_a_pass_claims_the_cluster_takes_the_seats_and_sends_each_a_held_assignment(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_PREPARE_TIMEOUT_SECS": 20}
    cluster = two_member_cluster()
    workers = idle_workers(2)
    inbox = Inbox(workers)
    result = run_pass()
    assert result.claimed == [cluster.pk]
    attempt = ClusterAttempt.objects.get()
    frames = [f for w in workers for f in inbox.frames(w)]
    assert sorted((f["cluster"]["role"], f["cluster"]["index"]) for f in frames) == [
        ("client", 0),
        ("server", 0),
    ]
    assert {f["cluster"]["attempt"] for f in frames} == {str(attempt.pk)}
    assert {f["cluster"]["hold_secs"] for f in frames} == {30}
    server = next(f for f in frames if f["cluster"]["role"] == "server")
    assert server["job"]["steps"] == ["fetch", "evaluate_flake", "evaluate_derivations"]
    # Both seats were taken with the claim: their idle slots of the seated kinds are gone.
    assert IdleSlot.objects.count() == 2
    assert set(DispatchedJob.objects.values_list("worker_id", flat=True)) == {w.pk for w in workers}
    # Not started yet: it waits for every acceptance.
    assert attempt.started_at is None


@pytest.mark.django_db
def test_a_seat_whose_worker_went_busy_since_the_snapshot_loses_the_claim():
    from clusters import planner
    from clusters.dispatch import snapshot

    cluster = two_member_cluster()
    idle_workers(2)
    ready = startable_clusters()
    [placement] = planner.plan(snapshot(ready, timezone.now()))
    rows = {m.key: m for m in ready[0].members}
    # One seat's worker took a single job meanwhile: its idle slot is gone.
    IdleSlot.objects.filter(worker=placement.seats[0].worker.id).delete()
    assert claim_placements((placement,), rows, timezone.now() - timedelta(seconds=25)) == set()
    assert not ClusterAttempt.objects.exists() and not DispatchedJob.objects.exists()
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.QUEUED


def test_a_cluster_without_a_full_placement_waits_and_claims_nothing():
    two_member_cluster()
    idle_workers(1)
    assert run_pass().claimed == []
    assert not ClusterAttempt.objects.exists()


def prepared():
    cluster = two_member_cluster(retry_budget=1)
    workers = idle_workers(2)
    inbox = Inbox(workers)
    run_pass()
    rows = list(DispatchedJob.objects.select_related("worker"))
    for w in workers:
        inbox.frames(w)  # the AssignJobs
    return cluster, workers, inbox, rows


def test_the_last_acceptance_starts_the_attempt_and_every_member_gets_the_roster():
    cluster, workers, inbox, rows = prepared()
    assert coordinator.accept_assignment(rows[0].worker_id, rows[0].job_id) is False
    assert all(inbox.frames(w) == [] for w in workers)
    assert coordinator.accept_assignment(rows[1].worker_id, rows[1].job_id) is True
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)
    for w in workers:
        [start] = inbox.frames(w)
        assert start["type"] == "StartCluster"
        assert sorted((r["role"], r["worker"]) for r in start["roster"]) == sorted(
            [
                ("client", next(r.worker.name for r in rows if r.job_id.startswith("build"))),
                ("server", next(r.worker.name for r in rows if r.job_id.startswith("eval"))),
            ]
        )
    evaluation = cluster.members.get(role="server").evaluation
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.EVALUATING_FLAKE


def test_the_roster_names_every_seat_with_its_role_index_and_worker_in_roster_order():
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    for _ in range(3):
        BuildMemberFactory(cluster_job=cluster, role="client")
    workers = idle_workers(4, zone="z1")
    for i, w in enumerate(workers):
        Worker.objects.filter(pk=w.pk).update(endpoint=f"10.0.0.{i}:7000")
    inbox = Inbox(workers)
    assert run_pass().claimed == [cluster.pk]
    for w in workers:
        inbox.frames(w)  # the AssignJobs
    rows = list(DispatchedJob.objects.all())
    assert [coordinator.accept_assignment(r.worker_id, r.job_id) for r in rows] == [
        False,
        False,
        False,
        True,
    ]
    # What _seats (clusters.book.role_indexes) makes of the started attempt.
    seats = coordinator._seats(rows[0].cluster_attempt_id)
    expected = [
        {
            "role": role,
            "index": index,
            "worker": row.worker.name,
            "zone": "z1",
            "endpoint": row.worker.endpoint,
        }
        for row, role, index in seats
    ]
    assert [(e["role"], e["index"]) for e in expected] == [
        ("client", 0),
        ("client", 1),
        ("client", 2),
        ("server", 0),
    ]
    for w in workers:
        [start] = inbox.frames(w)
        assert start["roster"] == expected


def test_two_last_acceptances_at_once_start_the_attempt_once_and_send_one_start_each():
    for _ in range(10):
        cluster = two_member_cluster()
        IdleSlot.objects.all().delete()
        workers = idle_workers(2)
        inbox = Inbox(workers)
        assert run_pass().claimed == [cluster.pk]
        for w in workers:
            inbox.frames(w)
        rows = list(DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster))
        started = race(
            *[lambda r=r: coordinator.accept_assignment(r.worker_id, r.job_id) for r in rows]
        )
        assert sorted(started) == [False, True]
        cluster.refresh_from_db()
        assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)
        assert not DispatchedJob.objects.filter(pk__in=[r.pk for r in rows], accepted_at=None)
        for w in workers:
            assert [f["type"] for f in inbox.frames(w)] == ["StartCluster"]


def test_an_acceptance_of_a_closed_or_unknown_member_row_is_refused_and_changes_nothing():
    _cluster, _workers, _inbox, rows = prepared()
    with pytest.raises(NotAllowed):
        coordinator.accept_assignment(rows[0].worker_id, "build:unknown")
    with pytest.raises(NotAllowed):  # another worker's row
        coordinator.accept_assignment(rows[1].worker_id, rows[0].job_id)
    coordinator.accept_assignment(rows[0].worker_id, rows[0].job_id)
    coordinator.member_rejected(rows[1].worker_id, rows[1].job_id, "busy")
    with pytest.raises(NotAllowed):  # the prepare failed: its rows are closed
        coordinator.accept_assignment(rows[1].worker_id, rows[1].job_id)
    assert DispatchedJob.objects.get(pk=rows[1].pk).accepted_at is None
    assert ClusterAttempt.objects.get().started_at is None


def test_a_rejecting_member_aborts_the_attempt_and_returns_the_cluster(settings):
    cluster, workers, inbox, rows = prepared()
    coordinator.accept_assignment(rows[0].worker_id, rows[0].job_id)
    coordinator.member_rejected(rows[1].worker_id, rows[1].job_id, "busy")
    attempt = ClusterAttempt.objects.get()
    assert attempt.outcome == AttemptOutcome.PREPARE_FAILED
    for w in workers:
        assert [f["type"] for f in inbox.frames(w)] == ["AbortCluster"]
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)
    build = cluster.members.get(role="client").derivation_build
    build.refresh_from_db()
    assert build.status == BuildStatus.QUEUED
    # It waits out the backoff before it can be placed again.
    assert startable_clusters() == []
    later = timezone.now() + timedelta(seconds=settings.GRADIENT["CLUSTER_RETRY_BACKOFF_SECS"] + 1)
    assert [c.id for c in startable_clusters(later)] == [cluster.pk]


def test_a_held_members_failure_is_a_failed_prepare_and_never_reaches_its_job():
    cluster, _workers, _inbox, rows = prepared()
    build_row = next(r for r in rows if r.kind == "build")
    member_report(build_row.worker_id, build_row.job_id, build_row.pk, "Failed", "aborted")
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.PREPARE_FAILED
    build = cluster.members.get(role="client").derivation_build
    build.refresh_from_db()
    assert build.status == BuildStatus.QUEUED  # not Aborted: the report stopped at the cluster
    cluster.refresh_from_db()
    assert cluster.attempts == 0


def test_an_overdue_prepare_times_out_like_a_reject(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_PREPARE_TIMEOUT_SECS": 0}
    _cluster, workers, inbox, _rows = prepared()
    result = run_pass()
    assert result.expired == 1
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.PREPARE_FAILED
    for w in workers:
        assert [f["type"] for f in inbox.frames(w)] == ["AbortCluster"]


def started():
    cluster, workers, inbox, rows = prepared()
    for row in rows:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    for w in workers:
        inbox.frames(w)
    return cluster, workers, inbox, rows


def test_a_signal_reaches_exactly_its_addressee():
    _cluster, workers, inbox, rows = started()
    attempt = str(rows[0].cluster_attempt_id)
    server = next(r for r in rows if r.kind == "eval")
    client = next(r for r in rows if r.kind == "build")
    sent = coordinator.forward_signal(
        server.worker_id, attempt, MemberRef(role="client", index=0), {"port": 5432}
    )
    assert sent == 1
    by_worker = {w.pk: inbox.frames(w) for w in workers}
    assert by_worker[server.worker_id] == []
    assert by_worker[client.worker_id] == [
        {
            "type": "ClusterSignal",
            "attempt": attempt,
            "from": {"role": "server", "index": 0},
            "payload": {"port": 5432},
        }
    ]
    # Without `to`, every other member gets it.
    assert coordinator.forward_signal(client.worker_id, attempt, None, "hi") == 1


def test_signals_from_outsiders_or_outside_a_started_attempt_are_dropped():
    _cluster, _workers, _inbox, rows = prepared()
    attempt = str(rows[0].cluster_attempt_id)
    with pytest.raises(NotAllowed):  # not started yet
        coordinator.forward_signal(rows[0].worker_id, attempt, None, 1)
    for row in rows:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    outsider = idle_workers(1)[0]
    with pytest.raises(NotAllowed):
        coordinator.forward_signal(outsider.pk, attempt, None, 1)
    with pytest.raises(NotAllowed):
        coordinator.forward_signal(rows[0].worker_id, attempt, MemberRef(role="db", index=0), 1)


@pytest.mark.django_db
def test_a_wake_up_is_worth_a_pass_only_while_a_cluster_waits_for_seats():
    assert not clusters_waiting()  # nothing queued: an idle worker's RequestJob wakes nothing
    cluster = two_member_cluster()
    assert clusters_waiting()
    attempt = ClusterAttempt.objects.create(cluster_job=cluster, created_at=timezone.now())
    assert not clusters_waiting()  # claimed: it waits for acceptances, not seats
    ClusterReservation.objects.create(cluster_job=cluster, created_at=timezone.now())
    assert clusters_waiting()  # a reservation commits once its seats are idle
    ClusterReservation.objects.update(released_at=timezone.now())
    attempt.finished_at = timezone.now()
    attempt.save()
    assert clusters_waiting()  # queued again after a failed prepare


@pytest.mark.django_db
def test_a_wake_up_while_a_pass_is_queued_asks_nothing_of_the_database(
    django_assert_num_queries,
):
    """Under a busy fleet every unanswered RequestJob wakes the pass: while one is queued,
    the wake-up reads Redis alone."""
    redis = _client()
    redis.delete(WAKE_KEY)
    try:
        with django_assert_num_queries(1):  # no pass queued: does any cluster wait?
            assert not wake_dispatch()  # none does
        two_member_cluster()
        redis.set(WAKE_KEY, 1, ex=10)  # a pass queued, not yet started
        with django_assert_num_queries(0):
            assert not wake_dispatch()
    finally:
        redis.delete(WAKE_KEY)


def test_after_a_failed_prepare_the_cluster_sits_elsewhere_if_it_can(settings):
    """A worker that never answers must not fail the cluster's every prepare while other
    workers could seat it."""
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_RETRY_BACKOFF_SECS": 0}
    _cluster, workers, _inbox, rows = prepared()
    answered, silent = rows
    coordinator.accept_assignment(answered.worker_id, answered.job_id)
    others = idle_workers(2)
    coordinator.abort_prepare(answered.cluster_attempt_id, "prepare timed out")
    for w in workers:  # both ask for work again
        record_idle(w.pk, "eval")
        record_idle(w.pk, "build")
    assert len(run_pass().claimed) == 1
    seated = set(
        DispatchedJob.objects.filter(finished_at__isnull=True).values_list("worker_id", flat=True)
    )
    assert silent.worker_id not in seated
    assert len(seated) == 2 and seated <= {w.pk for w in [*workers, *others]}


def test_every_worker_silent_since_the_last_start_is_avoided_not_only_the_last_ones(settings):
    """Two workers that never answer: avoiding only the last prepare's silent worker sent the
    cluster back and forth between them."""
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_RETRY_BACKOFF_SECS": 0}

    def fail_prepare(answering):
        rows = list(DispatchedJob.objects.filter(finished_at__isnull=True))
        silent = [r.worker_id for r in rows if r.worker_id != answering.pk]
        for row in rows:
            if row.worker_id == answering.pk:
                coordinator.accept_assignment(row.worker_id, row.job_id)
        coordinator.abort_prepare(rows[0].cluster_attempt_id, "prepare timed out")
        return silent

    _cluster, (answering, first), _inbox, _rows = prepared()
    assert fail_prepare(answering) == [first.pk]
    [second] = idle_workers(1)  # only the answering worker and a new one are idle
    for kind in ("eval", "build"):
        record_idle(answering.pk, kind)
    assert len(run_pass().claimed) == 1
    assert fail_prepare(answering) == [second.pk]
    others = idle_workers(2)
    for w in (answering, first, second):
        for kind in ("eval", "build"):
            record_idle(w.pk, kind)
    assert len(run_pass().claimed) == 1
    seated = set(
        DispatchedJob.objects.filter(finished_at__isnull=True).values_list("worker_id", flat=True)
    )
    assert seated.isdisjoint({first.pk, second.pk})
    assert len(seated) == 2 and seated <= {answering.pk, *(w.pk for w in others)}
