"""The restart sweep: everything it decides comes from stored rows and stored times."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.claim import ClusterClaim, claim_cluster
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from clusters.recovery import recover
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob, EvaluationStatus
from tests.clusterflow import accept_every_member
from tests.concurrency import race
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory


def live_workers(n):
    return WorkerFactory.create_batch(n, channel_name="live", last_seen_at=timezone.now())


def claimed(cluster_kwargs=None, workers=None, age=0.0, start=False):
    cluster = ClusterFactory(**(cluster_kwargs or {}))
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    workers = workers or live_workers(2)
    claim = ClusterClaim(
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


@pytest.mark.django_db
def test_an_aborted_member_job_aborts_its_started_attempt():
    cluster, attempt = claimed({"retry_budget": 3}, start=True)
    evaluation = cluster.members.get(role="server").evaluation
    evaluation.status = EvaluationStatus.ABORTED
    evaluation.save()
    recover()
    cluster.refresh_from_db()
    attempt.refresh_from_db()
    assert (cluster.status, attempt.outcome) == (ClusterStatus.ABORTED, AttemptOutcome.ABORTED)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("attempts", "budget", "dead", "expected"),
    [
        (1, 1, False, ClusterStatus.QUEUED),
        (2, 1, False, ClusterStatus.FAILED),
        (1, 5, True, ClusterStatus.ABORTED),
    ],
)
def test_a_running_cluster_without_an_open_attempt_is_settled(attempts, budget, dead, expected):
    cluster = ClusterFactory(status=ClusterStatus.RUNNING, attempts=attempts, retry_budget=budget)
    member = EvalMemberFactory(cluster_job=cluster)
    if dead:
        member.evaluation.status = EvaluationStatus.FAILED
        member.evaluation.save()
    assert recover()["settled"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.status == expected


@pytest.mark.django_db(transaction=True)
def test_sweeps_running_at_once_resolve_each_attempt_once():
    gone = WorkerFactory(channel_name=None)
    attempts = [claimed({"retry_budget": 1}, [gone, *live_workers(1)], start=True)[1]]
    attempts += [claimed(age=3600)[1] for _ in range(3)]
    first, second = race(recover, recover)
    assert sorted(first["resolved"] + second["resolved"]) == [attempts[0].pk]
    assert sorted(first["expired"] + second["expired"]) == sorted(a.pk for a in attempts[1:])
    assert not ClusterAttempt.objects.filter(finished_at__isnull=True).exists()
