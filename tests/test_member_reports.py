"""Member reports into the verdict, settled in one transaction, on the real database."""

import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from clusters import coordinator
from clusters.dispatch import run_pass
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from clusters.recovery import recover, resolve_orphaned_attempts
from clusters.settlement import abort_attempt, member_report
from clusters.verdict import LOST
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from gradient.jobs.transitions import advance_evaluation
from sessions.connection import detach
from sessions.liveness import disconnect_silent_workers
from tests.aborting import report, statuses
from tests.clusterflow import Inbox, committed, idle_workers
from tests.concurrency import Outcomes, frozen_connection, race, skewed
from tests.factories import (
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    WorkerFactory,
)
from workers.models import Worker


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


def started_cluster(retry_budget=0, primary=None):
    cluster = ClusterFactory(retry_budget=retry_budget)
    EvalMemberFactory(cluster_job=cluster, role="server", primary=primary == "server")
    BuildMemberFactory(cluster_job=cluster, role="client", primary=primary == "client")
    return (cluster, *start_attempt(cluster))


def start_attempt(cluster):
    """Two new idle workers; the dispatch pass claims the cluster on them, and both accept."""
    workers = idle_workers(2)
    inbox = Inbox(workers)
    assert run_pass().claimed == [cluster.pk]
    rows = {
        r.kind: r
        for r in DispatchedJob.objects.filter(
            cluster_attempt__cluster_job=cluster, cluster_attempt__finished_at__isnull=True
        )
    }
    for row in rows.values():
        coordinator.accept_assignment(row.worker_id, row.job_id)
    for w in workers:
        inbox.frames(w)
    return rows, inbox, workers


@committed
def test_a_member_report_holds_back_its_job_until_the_attempt_is_decided():
    cluster, rows, _, _ = started_cluster()
    assert report(rows["build"], "Completed") is None
    assert statuses(cluster) == (
        ClusterStatus.RUNNING,
        EvaluationStatus.EVALUATING_FLAKE,
        BuildStatus.BUILDING,
    )
    assert report(rows["eval"], "Completed") == "Complete"
    assert statuses(cluster) == (
        ClusterStatus.COMPLETED,
        EvaluationStatus.COMPLETED,
        BuildStatus.COMPLETED,
    )
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.SUCCEEDED


@committed
def test_the_primary_completes_the_cluster_and_aborts_its_companions():
    cluster, rows, inbox, workers = started_cluster(primary="server")
    assert report(rows["eval"], "Completed") == "Complete"
    assert statuses(cluster) == (
        ClusterStatus.COMPLETED,
        EvaluationStatus.COMPLETED,
        BuildStatus.ABORTED,
    )
    client = next(w for w in workers if w.pk == rows["build"].worker_id)
    assert [f["type"] for f in inbox.frames(client)] == ["AbortCluster"]
    assert DispatchedJob.objects.get(pk=rows["build"].pk).outcome == "Abandoned"


@committed
def test_a_completed_member_is_requeued_when_a_sibling_fails():
    cluster, rows, _, _ = started_cluster(retry_budget=1)
    report(rows["eval"], "Completed")
    assert report(rows["build"], "Failed", "transient") == "Retry"
    assert statuses(cluster) == (ClusterStatus.QUEUED, EvaluationStatus.QUEUED, BuildStatus.QUEUED)
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.FAILED


@committed
def test_a_spent_budget_turns_requeueing_kinds_permanent():
    cluster, rows, _, _ = started_cluster(retry_budget=0)
    assert report(rows["build"], "Failed", "transient") == "Fail"
    assert statuses(cluster) == (
        ClusterStatus.FAILED,
        EvaluationStatus.ABORTED,  # a survivor
        BuildStatus.FAILED_PERMANENT,
    )


@committed
def test_a_report_racing_the_resolution_is_settled_late_by_the_verdict():
    cluster, rows, _, _ = started_cluster(retry_budget=1)
    assert report(rows["build"], "Failed", "transient") == "Retry"
    # The survivor's own report arrives after the verdict: accepted, changes nothing.
    assert report(rows["eval"], "Completed") is None
    assert statuses(cluster) == (ClusterStatus.QUEUED, EvaluationStatus.QUEUED, BuildStatus.QUEUED)
    with pytest.raises(NotAllowed):
        report(rows["build"], "Completed")  # reported already


@committed
def test_an_abort_decides_the_attempt_and_tells_every_survivor():
    cluster, rows, inbox, workers = started_cluster(retry_budget=3)
    report(rows["eval"], "Completed")
    assert abort_attempt(ClusterAttempt.objects.get().pk, "operator")
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.COMPLETED,
        BuildStatus.ABORTED,
    )
    client = next(w for w in workers if w.pk == rows["build"].worker_id)
    assert [f["type"] for f in inbox.frames(client)] == ["AbortCluster"]


@committed
def test_an_abort_the_server_did_not_order_is_a_failure_retried_within_the_budget():
    cluster, rows, _, _ = started_cluster(retry_budget=1)
    assert report(rows["build"], "Failed", "aborted") == "Retry"
    assert statuses(cluster) == (ClusterStatus.QUEUED, EvaluationStatus.QUEUED, BuildStatus.QUEUED)
    rows, _, _ = start_attempt(cluster)
    assert report(rows["build"], "Failed", "aborted") == "Fail"
    # Its own outcome, an abort; the survivor ends Aborted too.
    assert statuses(cluster) == (
        ClusterStatus.FAILED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )


@committed
@pytest.mark.parametrize("outcome", ["Completed", "Failed"])
def test_an_evaluation_abort_that_reached_a_member_decides_abort(outcome):
    cluster, rows, inbox, workers = started_cluster(retry_budget=3)
    evaluation = cluster.members.get(role="server").evaluation
    assert advance_evaluation(evaluation.pk, EvaluationStatus.ABORTED)
    # Whichever report comes next (the aborted member's own, or its sibling's) decides Abort.
    row = rows["eval"] if outcome == "Failed" else rows["build"]
    assert report(row, outcome, "aborted" if outcome == "Failed" else None) == "Abort"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.ABORTED
    assert ClusterAttempt.objects.get().outcome == AttemptOutcome.ABORTED
    survivor = rows["build"] if outcome == "Failed" else rows["eval"]
    told = next(w for w in workers if w.pk == survivor.worker_id)
    assert [f["type"] for f in inbox.frames(told)] == ["AbortCluster"]


@committed
def test_retry_budget_bounds_retries_not_the_per_evaluation_assignment_budget(settings):
    settings.GRADIENT = {**settings.GRADIENT, "MAX_JOB_ATTEMPTS": 2}
    cluster, rows, _, _ = started_cluster(retry_budget=3)
    verdicts = [report(rows["eval"], "Failed", "transient")]
    for _ in range(3):
        rows, _, _ = start_attempt(cluster)
        verdicts.append(report(rows["eval"], "Failed", "transient"))
    # Four failed assignments of one evaluation, twice what a single job would get.
    assert verdicts == ["Retry", "Retry", "Retry", "Fail"]
    assert DispatchedJob.objects.filter(job_id=rows["eval"].job_id, outcome="Failed").count() == 4
    assert statuses(cluster) == (
        ClusterStatus.FAILED,
        EvaluationStatus.FAILED,
        BuildStatus.ABORTED,
    )


@committed
def test_a_disconnect_reports_a_member_lost_into_the_verdict_never_as_a_single_job():
    """Members count as tracked while their attempt is open: the abandoned-dispatch sweep
    (sessions.connection.abandon_single_assignments, on a disconnect) leaves them alone."""
    cluster, rows, _, _ = started_cluster(retry_budget=0)
    gone = rows["build"]
    Worker.objects.filter(pk=gone.worker_id).update(channel_name="socket")
    assert detach(gone.worker_id, "socket")
    assert DispatchedJob.objects.get(pk=gone.pk).failure_kind == LOST
    # Budget spent: a Fail; the lost build's requeueing outcome made permanent.
    assert statuses(cluster) == (
        ClusterStatus.FAILED,
        EvaluationStatus.ABORTED,
        BuildStatus.FAILED_PERMANENT,
    )


@committed
def test_no_member_row_waits_for_an_abort_to_be_confirmed(settings):
    """The verdict abandons every open row as it decides: a companion told AbortCluster whose
    worker never answers leaves nothing to reap when the worker is declared gone."""
    settings.GRADIENT = {**settings.GRADIENT, "WORKER_TIMEOUT_SECS": 120}
    cluster, rows, _, _ = started_cluster(primary="server")
    assert report(rows["eval"], "Completed") == "Complete"
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
    mute = rows["build"].worker_id
    Worker.objects.filter(pk=mute).update(last_seen_at=timezone.now() - timedelta(seconds=600))
    assert disconnect_silent_workers() == [mute]
    assert recover() == {"expired": [], "resolved": [], "settled": []}
    assert statuses(cluster) == (
        ClusterStatus.COMPLETED,
        EvaluationStatus.COMPLETED,
        BuildStatus.ABORTED,
    )


@committed
def test_the_sweep_reaping_an_aborted_member_and_a_siblings_report_decide_abort_once():
    outcomes = Outcomes("the sweep decided", "the report decided")
    for i in outcomes.rounds(at_least=100, at_most=200):
        cluster, rows, _, _ = started_cluster(retry_budget=1)
        attempt = rows["eval"].cluster_attempt_id
        evaluation = cluster.members.get(role="server").evaluation_id
        assert advance_evaluation(evaluation, EvaluationStatus.ABORTED)
        swept, reported = race(
            *skewed(resolve_orphaned_attempts, lambda r=rows: report(r["build"], "Completed"), i)
        )
        # Whichever came first decided Abort; the other found it decided.
        assert (swept == [attempt]) != (reported == "Abort"), (swept, reported)
        outcomes.saw("the sweep decided" if swept == [attempt] else "the report decided")
        cluster_status, _, build = statuses(cluster)
        assert cluster_status == ClusterStatus.ABORTED
        assert ClusterAttempt.objects.get(pk=attempt).outcome == AttemptOutcome.ABORTED
        # A completion that came first settles Completed; else the survivor ends Aborted.
        assert build == (BuildStatus.COMPLETED if reported else BuildStatus.ABORTED)
        assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


@committed
def test_simultaneous_reports_decide_the_attempt_once():
    for _ in range(100):
        cluster, rows, _, _ = started_cluster(retry_budget=1)
        verdicts = race(
            lambda r=rows: report(r["eval"], "Failed", "transient"),
            lambda r=rows: report(r["build"], "Completed"),
        )
        decided = [v for v in verdicts if v is not None]
        assert decided == ["Retry"], verdicts
        assert ClusterAttempt.objects.filter(cluster_job=cluster).get().outcome == "Failed"
        cluster.refresh_from_db()
        assert cluster.status == ClusterStatus.QUEUED
        # Out of the next iteration's way.
        type(cluster).objects.filter(pk=cluster.pk).update(status=ClusterStatus.FAILED)


@committed
def test_of_simultaneous_completions_the_later_sees_the_earlier_and_decides():
    # Neither member is primary: only the report that finds its sibling done decides.
    for _ in range(100):
        cluster, rows, _, _ = started_cluster()
        verdicts = race(
            lambda r=rows: report(r["eval"], "Completed"),
            lambda r=rows: report(r["build"], "Completed"),
        )
        assert sorted(map(str, verdicts)) == ["Complete", "None"], verdicts
        assert statuses(cluster) == (
            ClusterStatus.COMPLETED,
            EvaluationStatus.COMPLETED,
            BuildStatus.COMPLETED,
        )


@committed
def test_a_frozen_holder_of_the_attempt_costs_a_report_a_bounded_wait(settings):
    settings.GRADIENT = {**settings.GRADIENT, "CLAIM_LOCK_TIMEOUT_MS": 300}
    _, rows, _, _ = started_cluster()
    frozen = frozen_connection()
    try:
        frozen.execute(
            "SELECT 1 FROM cluster_attempt WHERE id = %s FOR UPDATE",
            [rows["build"].cluster_attempt_id],
        )
        began = time.monotonic()
        with pytest.raises(OperationalError):
            report(rows["build"], "Completed")
        assert time.monotonic() - began < 5
        assert DispatchedJob.objects.get(pk=rows["build"].pk).finished_at is None
    finally:
        frozen.rollback()
        frozen.close()
    assert report(rows["build"], "Completed") is None
    assert report(rows["eval"], "Completed") == "Complete"


@pytest.mark.django_db(transaction=True)  # SET LOCAL lasts until a real commit
def test_an_assignment_no_member_of_this_worker_holds_goes_to_single_or_is_refused():
    _, rows, _, _ = started_cluster()
    row, stranger = rows["build"], WorkerFactory()
    seen = []

    def single():
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            seen.append((cursor.fetchone()[0], connection.in_atomic_block))

    args = (stranger.pk, row.job_id, row.pk, "Failed", "transient")
    assert member_report(*args, single=single) is None
    # In the report's transaction, its lock waits as the session had them (unbounded).
    assert seen == [("0", True)]
    with pytest.raises(NotAllowed):
        member_report(*args)
    assert DispatchedJob.objects.get(pk=row.pk).finished_at is None
