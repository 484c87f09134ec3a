"""Aborting a cluster while something else decides it, on real concurrent connections: one
consistent verdict whoever wins, and each way a race can go is seen to go that way."""

import time

import pytest

from clusters import coordinator
from clusters.abort import AbortRefused, abort_cluster
from clusters.dispatch import run_pass
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from tests.aborting import (
    preparing_cluster,
    report,
    running_cluster,
    statuses,
    waiting_cluster,
    worker_of,
)
from tests.clusterflow import Inbox, idle_workers
from tests.concurrency import Outcomes, race, skewed
from workers.models import IdleSlot

pytestmark = pytest.mark.usefixtures("memory_layer")


ATTEMPT_OUTCOME = {
    ClusterStatus.ABORTED: AttemptOutcome.ABORTED,
    ClusterStatus.COMPLETED: AttemptOutcome.SUCCEEDED,
    ClusterStatus.FAILED: AttemptOutcome.FAILED,
}


def assert_consistent(cluster):
    """Settled for good: no open attempt or member row, the last attempt's outcome matching
    the cluster's status, and no member job still going."""
    status, evaluation, build = statuses(cluster)
    assert status in ATTEMPT_OUTCOME
    assert not ClusterAttempt.objects.filter(cluster_job=cluster, finished_at__isnull=True)
    assert not DispatchedJob.objects.filter(
        cluster_attempt__cluster_job=cluster, finished_at__isnull=True
    )
    last = ClusterAttempt.objects.filter(cluster_job=cluster).order_by("created_at").last()
    if last is not None and status == ClusterStatus.ABORTED:
        assert last.outcome in (AttemptOutcome.ABORTED, AttemptOutcome.FAILED)
    elif last is not None:
        assert last.outcome == ATTEMPT_OUTCOME[status]
    assert evaluation in (EvaluationStatus.COMPLETED, EvaluationStatus.ABORTED)
    assert build in (BuildStatus.COMPLETED, BuildStatus.ABORTED)


def outcome_of(call):
    """The call's result, or its refusal's message: a race's loser refuses, it never breaks."""

    def run():
        try:
            return call()
        except (AbortRefused, NotAllowed) as refused:
            return str(refused)

    return run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stage", ["waiting", "preparing", "running"])
def test_two_simultaneous_aborts_abort_once_and_the_other_is_refused(stage):
    for _ in range(8):
        if stage == "waiting":
            cluster, rows, inbox, workers = waiting_cluster(), {}, Inbox([]), []
        elif stage == "preparing":
            cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
        else:
            cluster, rows, inbox, workers = running_cluster()

        results = race(
            outcome_of(lambda c=cluster: abort_cluster(c.pk, "a")),
            outcome_of(lambda c=cluster: abort_cluster(c.pk, "b")),
        )

        assert sorted(results) == ["Aborted", f"cluster {cluster.pk} is already Aborted"]
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        for row in rows.values():
            types = sorted(f["type"] for f in inbox.frames(worker_of(row, workers)))
            # Told once, by the abort that won.
            assert types == (
                ["AbortCluster"] if stage == "preparing" else ["AbortCluster", "AbortJob"]
            )


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_the_primarys_deciding_report_leaves_one_consistent_verdict():
    outcomes = Outcomes("abort decided", "report decided")
    for i in outcomes.rounds(at_least=15):
        cluster, rows, _, _ = running_cluster()
        aborted, verdict = race(
            *skewed(
                outcome_of(lambda c=cluster: abort_cluster(c.pk)),
                outcome_of(lambda r=rows: report(r["eval"], "Completed")),
                i,
            )
        )
        status, evaluation, build = statuses(cluster)
        if status == ClusterStatus.ABORTED:  # the abort decided; the report came late
            outcomes.saw("abort decided")
            assert (aborted, verdict) == ("Aborted", None)
            assert (evaluation, build) == (EvaluationStatus.ABORTED, BuildStatus.ABORTED)
        else:  # the report decided Complete; the abort found the cluster finished
            outcomes.saw("report decided")
            assert (aborted, verdict) == (f"cluster {cluster.pk} is already Completed", "Complete")
            assert (status, evaluation, build) == (
                ClusterStatus.COMPLETED,
                EvaluationStatus.COMPLETED,
                BuildStatus.ABORTED,
            )
        assert_consistent(cluster)
        assert ClusterAttempt.objects.filter(cluster_job=cluster).count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_a_failing_report_with_a_retry_left_still_aborts():
    # Either the abort decided (the report came late) or the report decided Retry and the
    # abort then ended the queued cluster: it never stays queued.
    outcomes = Outcomes("abort decided", "report decided Retry")
    for i in outcomes.rounds(at_least=15):
        cluster, rows, _, _ = running_cluster(retry_budget=1)
        aborted, verdict = race(
            *skewed(
                outcome_of(lambda c=cluster: abort_cluster(c.pk)),
                outcome_of(lambda r=rows: report(r["build"], "Failed", "transient")),
                i,
            )
        )
        assert aborted == "Aborted"
        outcomes.saw({None: "abort decided", "Retry": "report decided Retry"}[verdict])
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_the_last_acceptance_aborts_whether_or_not_the_attempt_started():
    outcomes = Outcomes("started, then aborted", "aborted before it started")
    for i in outcomes.rounds(at_least=15):
        cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
        build = rows["build"]
        aborted, _started = race(
            *skewed(
                outcome_of(lambda c=cluster: abort_cluster(c.pk)),
                outcome_of(lambda r=build: coordinator.accept_assignment(r.worker_id, r.job_id)),
                i,
            )
        )
        assert aborted == "Aborted"
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        attempt = ClusterAttempt.objects.get(cluster_job=cluster)
        assert attempt.outcome == AttemptOutcome.ABORTED
        types = {f["type"] for f in inbox.frames(worker_of(build, workers))}
        # A start that won is followed by the abort of running members.
        assert ("AbortJob" in types) == (attempt.started_at is not None)
        assert "AbortCluster" in types
        started = attempt.started_at is not None
        outcomes.saw("started, then aborted" if started else "aborted before it started")


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_a_claim_leaves_the_cluster_aborted_and_nothing_open():
    outcomes = Outcomes("claimed, then aborted", "aborted before the claim")
    for i in outcomes.rounds(at_least=12):
        cluster = waiting_cluster()
        IdleSlot.objects.all().delete()
        idle_workers(2)

        def late_abort(c=cluster, delay=(i % 12) * 0.04):
            # The pass plans before it claims: a growing head start lets the claim win too.
            time.sleep(delay)
            return abort_cluster(c.pk)

        aborted, result = race(outcome_of(late_abort), run_pass)
        assert aborted == "Aborted"
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        if result.claimed:  # the abort closed the claimed attempt before it started
            outcomes.saw("claimed, then aborted")
            attempt = ClusterAttempt.objects.get(cluster_job=cluster)
            assert (attempt.outcome, attempt.started_at) == (AttemptOutcome.ABORTED, None)
        else:
            outcomes.saw("aborted before the claim")
            assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()
