"""An attempt after its claim: close_cluster_attempt, the start (the last member's acceptance,
coordinator.accept_assignment), fail-prepare and resolve (settlement.member_report), alone and
raced from real concurrent connections."""

import time

import pytest
from django.utils import timezone

from clusters.claim import (
    claim_cluster,
    close_cluster_attempt,
    fail_prepare_attempt,
)
from clusters.coordinator import abort_prepare, accept_assignment
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.settlement import member_report
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob, EvaluationStatus
from tests.clusterflow import (
    Inbox,
    accept_every_member,
    claim_for,
    claimed,
    make_cluster,
    open_rows,
)
from tests.concurrency import race
from tests.factories import WorkerFactory

TRIALS = 100


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


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
    for i in range(TRIALS):
        cluster = make_cluster()
        claim = claim_for(cluster, workers)
        assert claim_cluster(claim)
        first, last = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
        assert accept_assignment(first.worker_id, first.job_id) is False

        # Set off together, the failed prepare nearly always takes the lock first; staggered by
        # 0 to 9 ms, each side wins some trials, so both orders are checked.
        def fail_prepare(attempt_id=claim.attempt_id, lag=(i % 4) * 3 / 1000):
            time.sleep(lag)
            return abort_prepare(attempt_id, "prepare timed out")

        accepted, failed = race(
            refused(lambda r=last: accept_assignment(r.worker_id, r.job_id)), fail_prepare
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
