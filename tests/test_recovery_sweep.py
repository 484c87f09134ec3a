"""The restart sweep: everything it decides comes from stored rows and stored times."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.claim import ClusterClaim, claim_cluster
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from clusters.recovery import recover
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from tests.clusterflow import accept_every_member
from tests.concurrency import race
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory


def live_workers(n):
    return WorkerFactory.create_batch(n, channel_name="live", last_seen_at=timezone.now())


def claim_of(cluster, workers, age=0.0) -> ClusterClaim:
    return ClusterClaim(
        cluster_id=cluster.pk,
        members=[
            Assignment(
                ClaimGate(m.kind, m.evaluation_id or m.derivation_build_id),
                w.pk,
                cluster.project_id,
            )
            for m, w in zip(cluster.members.all(), workers, strict=True)
        ],
        now=timezone.now() - timedelta(seconds=age),
    )


def claimed(cluster_kwargs=None, workers=None, age=0.0, start=False):
    cluster = ClusterFactory(**(cluster_kwargs or {}))
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    claim = claim_of(cluster, workers or live_workers(2), age)
    assert claim_cluster(claim)
    if start:
        assert accept_every_member(claim.attempt_id)[-1]
    return cluster, ClusterAttempt.objects.get(pk=claim.attempt_id)


@pytest.mark.django_db
def test_a_prepare_past_its_stored_deadline_fails_on_the_first_sweep(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLUSTER_PREPARE_TIMEOUT_SECS": 30}
    _, overdue = claimed(age=31)
    _, young = claimed(age=5)
    assert recover()["expired"] == [overdue.pk]
    overdue.refresh_from_db()
    young.refresh_from_db()
    assert overdue.outcome == AttemptOutcome.PREPARE_FAILED
    assert young.finished_at is None
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == 1


@pytest.mark.django_db
def test_a_started_attempt_with_live_members_is_left_alone():
    cluster, _ = claimed(start=True, age=3600)
    assert recover() == {"expired": [], "resolved": [], "settled": []}
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.RUNNING


@pytest.mark.django_db
def test_a_member_whose_worker_went_silent_fails_the_attempt_and_retries_within_budget(
    settings,
):
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    silent = WorkerFactory(channel_name="stale", last_seen_at=timezone.now() - timedelta(300))
    cluster, attempt = claimed({"retry_budget": 1}, [silent, *live_workers(1)], start=True)
    assert recover()["resolved"] == [attempt.pk]
    attempt.refresh_from_db()
    cluster.refresh_from_db()
    assert attempt.outcome == AttemptOutcome.FAILED
    assert cluster.status == ClusterStatus.QUEUED
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


@pytest.mark.django_db
def test_a_lost_member_without_budget_fails_the_cluster():
    gone = WorkerFactory(channel_name=None, last_seen_at=timezone.now())
    cluster, _ = claimed({"retry_budget": 0}, [gone, *live_workers(1)], start=True)
    recover()
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.FAILED


def end_evaluation(cluster, status):
    """Its evaluation moved by someone else (an evaluation abort, a cancel, a removal)."""
    Evaluation.objects.filter(pk=cluster.members.get(role="server").evaluation_id).update(
        status=status
    )


def member_jobs(cluster):
    evaluation = cluster.members.get(role="server").evaluation
    build = cluster.members.get(role="client").derivation_build
    evaluation.refresh_from_db()
    build.refresh_from_db()
    return evaluation.status, build.status


@pytest.mark.django_db
def test_an_aborted_member_job_aborts_its_started_attempt_though_its_worker_never_confirms():
    """An evaluation abort reached a member and its worker never reports: the sweep reaps
    the member into the verdict, Abort."""
    cluster, attempt = claimed({"retry_budget": 3}, start=True)
    end_evaluation(cluster, EvaluationStatus.ABORTED)
    assert recover()["resolved"] == [attempt.pk]
    cluster.refresh_from_db()
    attempt.refresh_from_db()
    assert (cluster.status, attempt.outcome) == (ClusterStatus.ABORTED, AttemptOutcome.ABORTED)
    assert member_jobs(cluster) == (EvaluationStatus.ABORTED, BuildStatus.ABORTED)
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("ended", [EvaluationStatus.FAILED, EvaluationStatus.COMPLETED])
def test_a_member_job_that_ended_outside_the_attempt_fails_it_despite_budget(ended):
    """It can no longer start: Fail (not Abort, which only an evaluation abort decides)."""
    cluster, attempt = claimed({"retry_budget": 3}, start=True)
    end_evaluation(cluster, ended)
    assert recover()["resolved"] == [attempt.pk]
    cluster.refresh_from_db()
    attempt.refresh_from_db()
    assert (cluster.status, attempt.outcome) == (ClusterStatus.FAILED, AttemptOutcome.FAILED)
    # The ended job keeps its state; the survivor ends Aborted.
    assert member_jobs(cluster) == (ended, BuildStatus.ABORTED)
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


def stranded(attempts, budget, evaluation_status):
    """A Running cluster whose started attempt closed without a verdict: its build still
    Building, its evaluation as given."""
    cluster, attempt = claimed({"retry_budget": budget}, start=True)
    ClusterAttempt.objects.filter(pk=attempt.pk).update(
        finished_at=timezone.now(), outcome=AttemptOutcome.FAILED
    )
    DispatchedJob.objects.update(finished_at=timezone.now(), outcome="Abandoned")
    type(cluster).objects.filter(pk=cluster.pk).update(attempts=attempts)
    end_evaluation(cluster, evaluation_status)
    return cluster


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("attempts", "budget", "evaluation", "expected", "jobs"),
    [
        # Budget left: a Retry, both jobs back to the assignment passes.
        (1, 1, "EvaluatingFlake", "Queued", ("Queued", "Queued")),
        # Spent: a Fail, the lost members' requeueing outcome made permanent.
        (2, 1, "EvaluatingFlake", "Failed", ("Failed", "FailedPermanent")),
        # A member that can no longer start: a Fail, whatever the budget.
        (1, 5, "Failed", "Failed", ("Failed", "FailedPermanent")),
        # An evaluation abort reached a member: Abort.
        (1, 5, "Aborted", "Aborted", ("Aborted", "FailedPermanent")),
    ],
)
def test_a_running_cluster_without_an_open_attempt_is_settled_by_the_verdict(
    attempts, budget, evaluation, expected, jobs
):
    cluster = stranded(attempts, budget, evaluation)
    assert recover()["settled"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.status == expected
    assert member_jobs(cluster) == jobs
    assert recover()["settled"] == []


@pytest.mark.django_db
def test_a_running_cluster_retried_by_the_sweep_can_be_claimed_again():
    cluster = stranded(1, 1, "EvaluatingFlake")
    recover()
    # Its build no longer stuck Building: the next claim wins.
    assert claim_cluster(claim_of(cluster, live_workers(2)))


@pytest.mark.django_db(transaction=True)
def test_sweeps_running_at_once_resolve_each_attempt_once():
    gone = WorkerFactory(channel_name=None)
    attempts = [claimed({"retry_budget": 1}, [gone, *live_workers(1)], start=True)[1]]
    attempts += [claimed(age=3600)[1] for _ in range(3)]
    first, second = race(recover, recover)
    assert sorted(first["resolved"] + second["resolved"]) == [attempts[0].pk]
    assert sorted(first["expired"] + second["expired"]) == sorted(a.pk for a in attempts[1:])
    assert not ClusterAttempt.objects.filter(finished_at__isnull=True).exists()
