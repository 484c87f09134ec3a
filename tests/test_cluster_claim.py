"""claim_cluster and claim_clusters, close_cluster_attempt, the start (the last member's
acceptance, coordinator.accept_assignment), fail-prepare and resolve (settlement.member_report),
alone and raced from real concurrent connections."""

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from clusters.claim import (
    ClusterClaim,
    claim_cluster,
    claim_clusters,
    close_cluster_attempt,
    fail_prepare_attempt,
)
from clusters.coordinator import abort_prepare, accept_assignment
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.settlement import member_report
from gradient.errors import NotAllowed
from gradient.jobs.claim import Assignment, ClaimGate, claim_assignment
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob, EvaluationStatus
from tests.clusterflow import Inbox, accept_every_member
from tests.concurrency import frozen_connection, race
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot

TRIALS = 100


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


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


@pytest.mark.django_db
def test_closing_an_attempt_abandons_its_open_members_and_a_second_close_touches_nothing():
    cluster = make_cluster()
    claim = claimed(cluster)
    assert close_cluster_attempt(claim.attempt_id, AttemptOutcome.ABORTED) == cluster.pk
    rows = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
    assert {r.outcome for r in rows} == {"Abandoned"}
    finished = {r.pk: r.finished_at for r in rows}
    again = close_cluster_attempt(
        claim.attempt_id, AttemptOutcome.PREPARE_FAILED, cluster_status=ClusterStatus.ABORTED
    )
    assert again is None
    attempt = ClusterAttempt.objects.get()
    assert attempt.outcome == AttemptOutcome.ABORTED
    assert {r.pk: r.finished_at for r in rows.all()} == finished
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.QUEUED


@pytest.mark.django_db
def test_a_close_sets_the_cluster_only_when_asked_and_an_unstarted_close_spares_a_start():
    cluster = make_cluster()
    claim = claimed(cluster)
    assert accept_every_member(claim.attempt_id) == [False, True]
    assert close_cluster_attempt(claim.attempt_id, "PrepareFailed") is None  # started
    assert ClusterAttempt.objects.get().finished_at is None
    assert open_rows(cluster).count() == 2
    closed = close_cluster_attempt(
        claim.attempt_id, AttemptOutcome.SUCCEEDED, cluster_status=ClusterStatus.COMPLETED
    )
    assert closed == cluster.pk
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.COMPLETED
    assert not open_rows(cluster).exists()


@pytest.mark.django_db
def test_the_last_acceptance_runs_the_cluster_and_counts_the_attempt_once():
    cluster = make_cluster()
    claim = claimed(cluster)
    assert accept_every_member(claim.attempt_id) == [False, True]
    assert accept_every_member(claim.attempt_id) == [False, False]  # repeated, kept as first
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)
    assert ClusterAttempt.objects.get().started_at is not None
    evaluation = cluster.members.get(role="server").evaluation
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.EVALUATING_FLAKE


@pytest.mark.django_db
def test_a_closed_attempt_cannot_start():
    cluster = make_cluster()
    claim = claimed(cluster)
    assert close_cluster_attempt(claim.attempt_id, AttemptOutcome.ABORTED)
    with pytest.raises(NotAllowed):
        accept_every_member(claim.attempt_id)
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)
    assert ClusterAttempt.objects.get().started_at is None


@pytest.mark.django_db
def test_a_failed_prepare_keeps_the_budget_and_hands_the_builds_back():
    cluster = make_cluster(retry_budget=1)
    claim = claimed(cluster)
    assert fail_prepare_attempt(claim.attempt_id)
    assert not fail_prepare_attempt(claim.attempt_id)
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.PREPARE_FAILED
    build = cluster.members.get(role="client").derivation_build
    build.refresh_from_db()
    assert build.status == BuildStatus.QUEUED
    assert claim_cluster(claim_for(cluster, WorkerFactory.create_batch(2)))


@pytest.mark.django_db
def test_a_started_attempt_cannot_fail_its_prepare():
    cluster = make_cluster()
    attempt = started(cluster)
    assert not fail_prepare_attempt(attempt)
    assert ClusterAttempt.objects.get().finished_at is None
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)


def started(cluster):
    claim = claimed(cluster)
    assert accept_every_member(claim.attempt_id)[-1]
    return claim.attempt_id


def fail_build(attempt_id):
    """The build member reports JobFailed{transient} (settlement.member_report: the resolve)."""
    row = DispatchedJob.objects.get(cluster_attempt_id=attempt_id, kind="build")
    return member_report(row.worker_id, row.job_id, row.pk, "Failed", "transient")


# Resolve is settlement.member_report (the verdict itself: tests/test_verdict.py; more of its
# settling: tests/test_member_reports.py). These hold the budget and the dead-member rule.


@pytest.mark.django_db
def test_a_budget_of_one_retries_once_then_fails_the_cluster():
    cluster = make_cluster(retry_budget=1)
    assert fail_build(started(cluster)) == "Retry"
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 1)
    assert DerivationBuild.objects.get().status == BuildStatus.QUEUED
    assert fail_build(started(cluster)) == "Fail"
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.FAILED, 2)
    assert list(ClusterAttempt.objects.values_list("outcome", flat=True)) == ["Failed"] * 2


@pytest.mark.django_db
def test_a_dead_member_fails_the_cluster_despite_budget():
    cluster = make_cluster(retry_budget=5)
    attempt = started(cluster)
    evaluation = cluster.members.get(role="server").evaluation
    evaluation.status = EvaluationStatus.FAILED
    evaluation.save()
    assert fail_build(attempt) == "Fail"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.FAILED
    assert not open_rows(cluster).exists()


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


def refused(call):
    """The call's result, or "refused" for a NotAllowed: a race's loser refuses."""

    def run():
        try:
            return call()
        except NotAllowed:
            return "refused"

    return run


@pytest.mark.django_db(transaction=True)
def test_a_prepare_timeout_and_a_held_members_failure_close_the_attempt_once():
    """Both are fail-prepare (coordinator.abort_prepare, as the prepare timeout and a
    JobFailed before the start call it): one closes the attempt and tells the members, the
    other finds it closed and touches nothing."""
    workers = WorkerFactory.create_batch(2)
    inbox = Inbox(workers)
    closed = []
    for i in range(TRIALS):
        cluster = make_cluster()
        claim = claim_for(cluster, workers)
        assert claim_cluster(claim)
        held = DispatchedJob.objects.get(cluster_attempt_id=claim.attempt_id, kind="build")
        race(
            lambda c=claim: abort_prepare(c.attempt_id, "prepare timed out"),
            lambda r=held: member_report(r.worker_id, r.job_id, r.pk, "Failed", "transient"),
        )
        closed.append(str(claim.attempt_id))
        if len(closed) == 20 or i == TRIALS - 1:  # the layer holds 100 frames a channel
            for worker in workers:  # a second close would have told them twice
                frames = inbox.frames(worker)
                assert {f["type"] for f in frames} == {"AbortCluster"}
                assert sorted(f["attempt"] for f in frames) == sorted(closed)
            closed = []
        attempt = ClusterAttempt.objects.get(pk=claim.attempt_id)
        assert attempt.outcome == AttemptOutcome.PREPARE_FAILED
        rows = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
        assert all(r.finished_at for r in rows)
        assert {r.finished_at for r in rows if r.outcome == "Abandoned"} == {attempt.finished_at}
        cluster.refresh_from_db()
        assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)
        assert DerivationBuild.objects.get(pk=held.derivation_build_id).status == "Queued"


@pytest.mark.django_db(transaction=True)
def test_the_last_acceptance_racing_a_failed_prepare_is_consistent_either_way():
    workers = WorkerFactory.create_batch(2)
    wins = {"start": 0, "fail": 0}
    for _ in range(TRIALS):
        cluster = make_cluster()
        claim = claim_for(cluster, workers)
        assert claim_cluster(claim)
        first, last = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
        assert accept_assignment(first.worker_id, first.job_id) is False
        accepted, failed = race(
            refused(lambda r=last: accept_assignment(r.worker_id, r.job_id)),
            lambda c=claim: abort_prepare(c.attempt_id, "prepare timed out"),
        )
        cluster.refresh_from_db()
        attempt = ClusterAttempt.objects.get(pk=claim.attempt_id)
        evaluation = cluster.members.get(role="server").evaluation
        build = cluster.members.get(role="client").derivation_build
        if accepted is True:
            wins["start"] += 1
            assert failed is False
            assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)
            assert attempt.finished_at is None and attempt.started_at is not None
            assert open_rows(cluster).count() == 2
            assert (evaluation.status, build.status) == ("EvaluatingFlake", "Building")
        else:
            wins["fail"] += 1
            assert (accepted, failed) == ("refused", True)
            assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 0)
            assert attempt.outcome == AttemptOutcome.PREPARE_FAILED
            assert attempt.started_at is None and not open_rows(cluster).exists()
            assert (evaluation.status, build.status) == ("Queued", "Queued")
        # Out of the next trial's way (a Running cluster keeps its workers' rows open).
        ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.COMPLETED)
        DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id).update(
            finished_at=timezone.now()
        )
    assert all(wins.values()), wins


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
    worker = WorkerFactory()
    frozen = frozen_connection()
    try:
        # An uncommitted open row for one member: the claim must wait on it, then give up.
        frozen.execute(
            "INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, worker_id, project_id,"
            " steps, dispatched_at) VALUES (gen_random_uuid(), 'eval', %s, %s, %s, %s, '{}',"
            " now())",
            [server.job_key, server.evaluation_id, worker.pk, cluster.project_id],
        )
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
        rival.execute(
            "INSERT INTO dispatched_job (id, kind, job_id, derivation_build_id, worker_id,"
            " project_id, steps, dispatched_at) VALUES (gen_random_uuid(), 'build', %s, %s, %s,"
            " %s, '{}', now())",
            [
                contested.job_key,
                contested.derivation_build_id,
                WorkerFactory().pk,
                clusters[1].project_id,
            ],
        )

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
        frozen.execute(
            "INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, worker_id, project_id,"
            " steps, dispatched_at) VALUES (gen_random_uuid(), 'eval', %s, %s, %s, %s, '{}',"
            " now())",
            [server.job_key, server.evaluation_id, WorkerFactory().pk, clusters[1].project_id],
        )
        claims = [claim_for(c, WorkerFactory.create_batch(2)) for c in clusters]
        assert claim_clusters(claims) == [True, False, True]
    finally:
        frozen.rollback()
        frozen.close()
    for cluster in clusters:
        assert_whole_or_nothing(cluster)
