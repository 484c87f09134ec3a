"""claim_cluster, the spec's Claim: one attempt with an open row for every member, or nothing
at all, alone and raced from real concurrent connections. The dispatch pass's batch of claims:
tests/test_cluster_claim_batch.py."""

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from clusters.claim import (
    ClusterClaim,
    claim_cluster,
    claim_clusters,
)
from clusters.models import ClusterAttempt, ClusterStatus
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from tests.clusterflow import (
    assert_whole_or_nothing,
    claim_assignment,
    claim_for,
    claimed,
    hold_open_row,
    make_cluster,
    open_rows,
    seated_claim_for,
    wait_for_lock_waits,
)
from tests.concurrency import frozen_connection, race
from tests.factories import EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot

TRIALS = 100


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


@pytest.mark.django_db
def test_a_claim_opens_an_attempt_and_claims_every_member():
    cluster = make_cluster()
    claim = claimed(cluster)
    attempt = ClusterAttempt.objects.get()
    assert attempt.pk == claim.attempt_id and attempt.started_at is None
    assert open_rows(cluster).filter(cluster_attempt=attempt).count() == 2
    build = cluster.members.get(role="client").derivation_build
    build.refresh_from_db()
    assert build.status == BuildStatus.BUILDING  # the Assigned transition
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)


@pytest.mark.django_db
def test_a_claim_without_members_opens_no_attempt():
    cluster = make_cluster()
    assert not claim_cluster(ClusterClaim(cluster_id=cluster.pk, members=[]))
    assert not ClusterAttempt.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["Running", "Completed", "Failed", "Aborted"])
def test_only_a_queued_cluster_can_be_claimed(status):
    cluster = make_cluster(status=status)
    assert not claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))
    assert not ClusterAttempt.objects.exists() and not DispatchedJob.objects.exists()


@pytest.mark.django_db
def test_a_member_open_as_a_single_assignment_rolls_the_whole_attempt_back():
    cluster = make_cluster()
    server = cluster.members.get(role="server")
    single = Assignment(
        ClaimGate("eval", server.evaluation_id), WorkerFactory().pk, cluster.project_id
    )
    assert claim_assignment(single)
    assert not claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))
    assert not ClusterAttempt.objects.exists()
    assert list(DispatchedJob.objects.values_list("id", flat=True)) == [single.id]
    build = cluster.members.get(role="client").derivation_build
    build.refresh_from_db()
    assert build.status == BuildStatus.QUEUED


@pytest.mark.django_db
def test_a_member_that_cannot_start_loses_the_claim():
    cluster = make_cluster()
    server = cluster.members.get(role="server").evaluation
    server.status = EvaluationStatus.ABORTED
    server.save()
    assert not claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))
    assert not ClusterAttempt.objects.exists() and not DispatchedJob.objects.exists()


# Races: every call runs on its own connection, released together by a barrier.


@pytest.mark.django_db(transaction=True)
def test_two_claimers_of_one_cluster_exactly_one_wins_and_nothing_is_partial():
    """Members listed in opposite orders too. Only claims of one cluster can share a member
    job (a job is a member of one cluster at most: the unique indexes of cluster_member), and
    the second of them waits at its attempt's insert, before any member: they cannot
    deadlock on members. What claims of different clusters can share is a seat (below)."""
    workers = WorkerFactory.create_batch(4)
    for _ in range(TRIALS):
        cluster = make_cluster()
        a, b = claim_for(cluster, workers[:2]), claim_for(cluster, workers[2:], reverse=True)
        results = race(lambda a=a: claim_cluster(a), lambda b=b: claim_cluster(b))
        assert sorted(results) == [False, True]
        assert_whole_or_nothing(cluster)
        winner = a if results[0] else b
        assert ClusterAttempt.objects.get(cluster_job=cluster).pk == winner.attempt_id


@pytest.mark.django_db(transaction=True)
def test_a_single_assignment_racing_a_cluster_claim_of_its_job_never_both():
    workers = WorkerFactory.create_batch(3)
    wins = {"single": 0, "cluster": 0}
    for i in range(TRIALS):
        cluster = make_cluster()
        member = cluster.members.get(role="server" if i % 2 else "client")
        gate = ClaimGate(member.kind, member.evaluation_id or member.derivation_build_id)
        single = Assignment(gate, workers[2].pk, cluster.project_id)
        claim = claim_for(cluster, workers[:2])
        single_won, cluster_won = race(
            lambda s=single: claim_assignment(s), lambda c=claim: claim_cluster(c)
        )
        assert single_won != cluster_won
        wins["single" if single_won else "cluster"] += 1
        assert_whole_or_nothing(cluster)
        assert open_rows(cluster).filter(job_id=member.job_key).count() == 1
    assert all(wins.values()), wins  # both orders really happened


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("batched", [False, True], ids=["claim_cluster", "claim_clusters"])
def test_claims_of_two_clusters_over_the_same_seats_in_opposite_orders_never_deadlock(
    batched, caplog
):
    """Seats are what claims of different clusters share. A third transaction holds the
    middle seat while both claims queue behind it, one having taken the seats before it in
    its order, the other (listing them reversed) those after it, unless seats are taken in
    one order; then it lets go. A fleet's idle slots make the planner probe them seat by seat,
    as in production."""
    claim = (lambda c: claim_clusters([c])[0]) if batched else claim_cluster
    workers = WorkerFactory.create_batch(3)
    now = timezone.now()
    IdleSlot.objects.bulk_create(
        IdleSlot(worker=w, kind=k, recorded_at=now)
        for w in WorkerFactory.create_batch(500)
        for k in ("eval", "build")
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE idle_slot")
    since = now - timedelta(seconds=25)
    holder = frozen_connection()
    try:
        for _ in range(TRIALS):
            x, y = make_cluster(), make_cluster()
            for cluster in (x, y):
                EvalMemberFactory(cluster_job=cluster, role="db")
            a, b = seated_claim_for(x, workers, since), seated_claim_for(y, workers, since)
            b.idle_seats.reverse()
            holder.execute(
                "SELECT 1 FROM idle_slot WHERE (worker_id, kind) = (%s, %s) FOR UPDATE",
                a.idle_seats[1],
            )

            def let_go():
                try:
                    return wait_for_lock_waits(2)
                finally:
                    holder.rollback()

            won_a, won_b, queued = race(lambda a=a: claim(a), lambda b=b: claim(b), let_go)
            assert queued
            assert sorted([won_a, won_b]) == [False, True]
            for cluster in (x, y):
                assert_whole_or_nothing(cluster)
            assert not IdleSlot.objects.filter(worker__in=workers).exists()
    finally:
        holder.close()
    # A deadlock (or a lock_timeout) loses a claim with a warning; none may happen.
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.django_db(transaction=True)
def test_a_frozen_rival_costs_a_claimer_a_bounded_wait_not_a_hang(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLAIM_LOCK_TIMEOUT_MS": 300}
    cluster = make_cluster()
    server = cluster.members.get(role="server")
    frozen = frozen_connection()
    try:
        # An uncommitted open row for one member: the claim must wait on it, then give up.
        hold_open_row(frozen, server, cluster.project_id)
        began = time.monotonic()
        assert not claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))
        assert time.monotonic() - began < 5
        assert not ClusterAttempt.objects.exists()
    finally:
        frozen.rollback()
        frozen.close()
    assert claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))


@pytest.mark.django_db
def test_server_connections_end_transactions_left_idle():
    with connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] == "1min"
