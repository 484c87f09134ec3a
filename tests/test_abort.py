"""Aborting a cluster as an evaluation abort would: one transaction for a waiting cluster,
the Abort verdict for an open attempt, refusals that change nothing."""

import pytest

from clusters import coordinator
from clusters.abort import AbortRefused, AlreadyFinished, UnknownCluster, abort_cluster
from clusters.dispatch import run_pass
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterStatus
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from sessions.reports import job_failed
from tests.aborting import (
    drain,
    preparing_cluster,
    report,
    running_cluster,
    snapshot,
    statuses,
    waiting_cluster,
    worker_of,
)
from tests.clusterflow import Inbox, committed, idle_workers

pytestmark = pytest.mark.usefixtures("memory_layer")


# Waiting: no open attempt.


@pytest.mark.django_db
@pytest.mark.parametrize("status", [ClusterStatus.QUEUED, ClusterStatus.RUNNING])
def test_a_cluster_without_an_open_attempt_ends_aborted_with_its_member_jobs(status):
    # Running without an open attempt is the stranded state a crash can leave.
    cluster = waiting_cluster(status=status)
    workers = idle_workers(1)
    inbox = Inbox(workers)

    assert abort_cluster(cluster.pk, "operator") == ClusterStatus.ABORTED

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()
    assert inbox.frames(workers[0]) == []


@committed
def test_an_aborted_waiting_cluster_is_never_claimed():
    cluster = waiting_cluster()
    abort_cluster(cluster.pk)
    idle_workers(2)

    assert run_pass().claimed == []
    assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()


@pytest.mark.django_db
def test_a_member_job_that_already_ended_keeps_its_status():
    cluster = waiting_cluster()
    build = cluster.members.get(role="client").derivation_build
    type(build).objects.filter(pk=build.pk).update(status=BuildStatus.SUBSTITUTED)

    abort_cluster(cluster.pk)

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.SUBSTITUTED,
    )


# Preparing: an open attempt not yet started.


@committed
@pytest.mark.parametrize("accepted", [(), ("eval",)], ids=["none-accepted", "one-accepted"])
def test_a_preparing_cluster_closes_its_attempt_aborted_and_tells_every_held_member(accepted):
    cluster, rows, inbox, workers = preparing_cluster(accepted=accepted)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert statuses(cluster)[1:] == (EvaluationStatus.QUEUED, BuildStatus.BUILDING)

    assert abort_cluster(cluster.pk, "operator says stop") == ClusterStatus.ABORTED

    attempt.refresh_from_db()
    assert (attempt.outcome, attempt.started_at) == (AttemptOutcome.ABORTED, None)
    assert attempt.finished_at is not None
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    assert set(DispatchedJob.objects.filter(cluster_attempt=attempt).values_list("outcome")) == {
        ("Abandoned",)
    }
    for row in rows.values():
        assert inbox.frames(worker_of(row, workers)) == [
            {"type": "AbortCluster", "attempt": str(attempt.pk), "reason": "operator says stop"}
        ]


@committed
def test_a_preparing_cluster_aborted_never_starts():
    cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
    abort_cluster(cluster.pk)
    drain(inbox, workers)

    with pytest.raises(NotAllowed):  # its hold is gone
        coordinator.accept_assignment(rows["build"].worker_id, rows["build"].job_id)

    assert ClusterAttempt.objects.get(cluster_job=cluster).started_at is None
    assert statuses(cluster)[0] == ClusterStatus.ABORTED
    assert all(inbox.frames(w) == [] for w in workers)  # no StartCluster


# Running: a started attempt, decided with the Abort verdict.


@committed
def test_a_running_cluster_is_decided_abort_and_its_running_members_get_abort_job():
    cluster, rows, inbox, workers = running_cluster(retry_budget=3)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)

    assert abort_cluster(cluster.pk, "operator") == ClusterStatus.ABORTED

    attempt.refresh_from_db()
    assert attempt.outcome == AttemptOutcome.ABORTED
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    for row in rows.values():
        frames = inbox.frames(worker_of(row, workers))
        assert {"type": "AbortJob", "job_id": row.job_id, "reason": "operator"} in frames
        assert {"type": "AbortCluster", "attempt": str(attempt.pk), "reason": "operator"} in frames
        assert len(frames) == 2


@committed
def test_a_member_that_completed_settles_completed_and_only_the_survivor_is_aborted():
    cluster, rows, inbox, workers = running_cluster(retry_budget=3)
    assert report(rows["build"], "Completed") is None  # not primary: the attempt goes on

    abort_cluster(cluster.pk, "operator")

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.COMPLETED,
    )
    assert inbox.frames(worker_of(rows["build"], workers)) == []
    frames = inbox.frames(worker_of(rows["eval"], workers))
    assert [f["type"] for f in frames] == ["AbortCluster", "AbortJob"]
    assert frames[1]["job_id"] == rows["eval"].job_id
    outcomes = dict(
        DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster).values_list(
            "kind", "outcome"
        )
    )
    assert outcomes == {"build": "Completed", "eval": "Abandoned"}


@committed
def test_the_aborted_workers_later_job_failed_reports_are_accepted_and_change_nothing():
    cluster, rows, _, _ = running_cluster()
    abort_cluster(cluster.pk)
    before = snapshot(cluster)

    for row in rows.values():
        job_failed(row.worker_id, row.job_id, str(row.pk), "aborted")

    assert snapshot(cluster) == before
    assert statuses(cluster)[0] == ClusterStatus.ABORTED


# Refusals: nothing changed.


@pytest.mark.django_db
@pytest.mark.parametrize(
    "status", [ClusterStatus.COMPLETED, ClusterStatus.FAILED, ClusterStatus.ABORTED]
)
def test_a_finished_cluster_is_refused_and_nothing_changes(status):
    cluster = waiting_cluster(status=status)
    before = snapshot(cluster)

    with pytest.raises(AlreadyFinished, match=f"^cluster {cluster.pk} is already {status}$"):
        abort_cluster(cluster.pk)

    assert snapshot(cluster) == before


@committed
def test_a_cluster_a_report_completed_is_refused_and_its_workers_hear_nothing():
    cluster, rows, inbox, workers = running_cluster()
    assert report(rows["eval"], "Completed") == "Complete"  # the primary
    drain(inbox, workers)
    before = snapshot(cluster)

    with pytest.raises(AlreadyFinished, match="already Completed"):
        abort_cluster(cluster.pk)

    assert snapshot(cluster) == before
    assert all(inbox.frames(w) == [] for w in workers)


@pytest.mark.django_db
def test_an_unknown_cluster_is_refused():
    with pytest.raises(UnknownCluster, match=r"^unknown cluster 424242$"):
        abort_cluster(424242)


@pytest.mark.django_db
def test_an_overlong_reason_is_refused_and_nothing_changes():
    cluster = waiting_cluster()
    before = snapshot(cluster)

    with pytest.raises(AbortRefused, match="reason is longer"):
        abort_cluster(cluster.pk, "x" * 1001)

    assert snapshot(cluster) == before
