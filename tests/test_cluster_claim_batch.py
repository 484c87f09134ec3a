"""claim_clusters, the dispatch pass's batch of claims: one transaction for many clusters, each
claim still winning or losing on its own, alone and raced from real concurrent connections."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.claim import (
    claim_cluster,
    claim_clusters,
)
from clusters.models import ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import BuildStatus, EvaluationStatus
from tests.clusterflow import (
    assert_whole_or_nothing,
    claim_assignment,
    claim_for,
    hold_open_row,
    make_cluster,
    open_rows,
    seated_claim_for,
    wait_for_lock_waits,
)
from tests.concurrency import frozen_connection, race
from tests.factories import WorkerFactory
from workers.models import IdleSlot

TRIALS = 100


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


# Batches: many clusters claimed in one transaction, each winning or losing on its own.


@pytest.mark.django_db(transaction=True)
def test_a_batch_claims_each_cluster_on_its_own():
    since = timezone.now() - timedelta(seconds=25)
    clusters = [make_cluster() for _ in range(4)]
    claims = [seated_claim_for(c, WorkerFactory.create_batch(2), since) for c in clusters]
    # 0: a member is open as a single assignment; 1: a seat's idle slot went stale;
    # 2: the cluster is no longer Queued; 3: nothing in the way.
    server = clusters[0].members.get(role="server")
    single = Assignment(
        ClaimGate("eval", server.evaluation_id), WorkerFactory().pk, clusters[0].project_id
    )
    assert claim_assignment(single)
    IdleSlot.objects.filter(worker_id=claims[1].idle_seats[1][0]).update(
        recorded_at=since - timedelta(seconds=1)
    )
    ClusterJob.objects.filter(pk=clusters[2].pk).update(status=ClusterStatus.RUNNING)

    assert claim_clusters(claims) == [False, False, False, True]

    for cluster in clusters:
        assert_whole_or_nothing(cluster)
    assert ClusterAttempt.objects.get().pk == claims[3].attempt_id
    assert list(open_rows(clusters[0]).values_list("id", flat=True)) == [single.id]
    for cluster in clusters[:3]:
        build = cluster.members.get(role="client").derivation_build
        build.refresh_from_db()
        assert build.status == BuildStatus.QUEUED
    # The losers' seats stay idle; the winner took its own.
    for claim in claims[:3]:
        assert IdleSlot.objects.filter(worker_id__in=[w for w, _ in claim.idle_seats]).count() == 2
    assert not IdleSlot.objects.filter(worker_id__in=[w for w, _ in claims[3].idle_seats]).exists()


@pytest.mark.django_db
def test_a_batch_holds_each_member_to_its_own_start_condition():
    """The batch's set-based claim statement repeats ClaimGate.condition: a build must still be
    Queued in the substitute mode seen, an evaluation not finished. Either way only that
    member's cluster loses."""
    since = timezone.now() - timedelta(seconds=25)
    clusters = [make_cluster() for _ in range(4)]
    claims = [seated_claim_for(c, WorkerFactory.create_batch(2), since) for c in clusters]
    builds = [c.members.get(role="client").derivation_build for c in clusters]
    # 0: the build's substitute mode changed since the snapshot; 1: the build left Queued;
    # 2: the evaluation finished; 3: nothing in the way.
    builds[0].cache_available = not builds[0].cache_available
    builds[0].save(update_fields=["cache_available"])
    builds[1].status = BuildStatus.COMPLETED
    builds[1].save(update_fields=["status"])
    evaluation = clusters[2].members.get(role="server").evaluation
    evaluation.status = EvaluationStatus.COMPLETED
    evaluation.save(update_fields=["status"])

    assert claim_clusters(claims) == [False, False, False, True]
    for cluster in clusters:
        assert_whole_or_nothing(cluster)
    assert ClusterAttempt.objects.get().pk == claims[3].attempt_id


def assert_claims_consistent(claims, won):
    """Each cluster won by one claim at most, whole or not at all; each seat taken by one
    winner at most, and gone exactly when one took it."""
    winners = [c for c, w in zip(claims, won, strict=True) if w]
    for cluster_id in {c.cluster_id for c in claims}:
        mine = [c for c in winners if c.cluster_id == cluster_id]
        assert len(mine) <= 1, cluster_id
        assert_whole_or_nothing(ClusterJob.objects.get(pk=cluster_id))
        open_attempt = ClusterAttempt.objects.filter(
            cluster_job_id=cluster_id, finished_at__isnull=True
        )
        assert list(open_attempt.values_list("pk", flat=True)) == [c.attempt_id for c in mine]
    taken = [seat for c in winners for seat in c.idle_seats]
    assert len(taken) == len(set(taken))
    for seat in {seat for c in claims for seat in c.idle_seats}:
        left = IdleSlot.objects.filter(worker_id=seat[0], kind=seat[1]).exists()
        assert left == (seat not in taken), seat


RIVALS = {
    "claim_clusters": claim_clusters,
    "claim_cluster": lambda claims: [claim_cluster(c) for c in claims],
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("rival", RIVALS)
def test_a_batch_racing_a_rival_over_the_same_clusters_and_seats_never_double_claims(rival):
    """The batch claims x on seats p and y on seats q. The rival, another batch, claims y on
    p and x on q, so that every cluster and every seat is contested, in the other order; or
    claim_cluster claims y on p."""
    workers = WorkerFactory.create_batch(4)
    p, q = workers[:2], workers[2:]
    wins = {"batch": 0, "rival": 0}
    for _ in range(TRIALS):
        since = timezone.now() - timedelta(seconds=25)
        x, y = make_cluster(), make_cluster()
        batch = [seated_claim_for(x, p, since), seated_claim_for(y, q, since)]
        rivals = [seated_claim_for(y, p, since)]
        if rival == "claim_clusters":
            rivals.append(seated_claim_for(x, q, since))
        won, won_rival = race(lambda c=batch: claim_clusters(c), lambda c=rivals: RIVALS[rival](c))
        assert_claims_consistent(batch + rivals, won + won_rival)
        wins["batch"] += any(won)
        wins["rival"] += any(won_rival)
    assert all(wins.values()), wins


@pytest.mark.django_db(transaction=True)
def test_a_single_assignment_racing_a_batch_costs_only_its_own_cluster():
    workers = WorkerFactory.create_batch(7)
    wins = {"single": 0, "cluster": 0}
    for i in range(TRIALS):
        since = timezone.now() - timedelta(seconds=25)
        clusters = [make_cluster() for _ in range(3)]
        member = clusters[1].members.get(role="server" if i % 2 else "client")
        gate = ClaimGate(member.kind, member.evaluation_id or member.derivation_build_id)
        single = Assignment(gate, workers[6].pk, clusters[1].project_id)
        claims = [
            seated_claim_for(c, workers[2 * j : 2 * j + 2], since) for j, c in enumerate(clusters)
        ]
        single_won, batch = race(
            lambda s=single: claim_assignment(s), lambda c=claims: claim_clusters(c)
        )
        assert batch[0] and batch[2]  # never dragged down by the middle one
        assert single_won != batch[1]
        wins["single" if single_won else "cluster"] += 1
        assert_claims_consistent(claims, batch)
        assert open_rows(clusters[1]).filter(job_id=member.job_key).count() == 1
    assert all(wins.values()), wins


@pytest.mark.django_db(transaction=True)
def test_a_member_claimed_by_a_rival_meanwhile_rolls_the_batch_back_and_each_goes_alone(caplog):
    """A rival's claim of a member, not committed yet when the batch claims it, commits while
    the batch waits on its row: that member's claim inserts nothing, so the batch rolls back
    (there is nothing to undo) and each claim goes again alone: only the contested cluster
    loses."""
    since = timezone.now() - timedelta(seconds=25)
    clusters = [make_cluster() for _ in range(3)]
    claims = [seated_claim_for(c, WorkerFactory.create_batch(2), since) for c in clusters]
    contested = clusters[1].members.get(role="client")
    rival = frozen_connection()
    try:
        hold_open_row(rival, contested, clusters[1].project_id)

        def commit_once_waited_on():
            try:
                return wait_for_lock_waits(1)
            finally:
                rival.commit()

        won, waited = race(lambda: claim_clusters(claims), commit_once_waited_on)
    finally:
        rival.close()
    assert waited
    assert won == [True, False, True]
    for cluster in clusters:
        assert_whole_or_nothing(cluster)
    builds = [c.members.get(role="client").derivation_build for c in clusters]
    for build in builds:
        build.refresh_from_db()
    assert [b.status for b in builds] == [BuildStatus.BUILDING, BuildStatus.QUEUED, "Building"]
    assert_claims_consistent(claims, won)
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.django_db(transaction=True)
def test_a_frozen_rival_in_a_batch_costs_only_its_own_cluster(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLAIM_LOCK_TIMEOUT_MS": 300}
    clusters = [make_cluster() for _ in range(3)]
    server = clusters[1].members.get(role="server")
    frozen = frozen_connection()
    try:
        hold_open_row(frozen, server, clusters[1].project_id)
        claims = [claim_for(c, WorkerFactory.create_batch(2)) for c in clusters]
        assert claim_clusters(claims) == [True, False, True]
    finally:
        frozen.rollback()
        frozen.close()
    for cluster in clusters:
        assert_whole_or_nothing(cluster)
