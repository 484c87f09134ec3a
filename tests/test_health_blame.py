"""Blame: the seat that ended its attempt, written with it in the closing transaction."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import coordinator
from clusters.blame import blame_for
from clusters.claim import claim_cluster
from clusters.models import ClusterAttempt
from clusters.settlement import member_report
from gradient.jobs.models import DispatchedJob
from sessions.connection import detach
from tests.clusterflow import claim_for, make_cluster
from tests.factories import WorkerFactory
from workers.models import Worker


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


def prepared(workers=None, **cluster):
    """A cluster of two claimed on two workers (or the given ones); its attempt's rows by
    kind."""
    cluster = make_cluster(**cluster)
    workers = workers or [WorkerFactory(channel_name="live"), WorkerFactory(channel_name="live")]
    claim = claim_for(cluster, workers)
    assert claim_cluster(claim)
    rows = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
    return claim.attempt_id, {r.kind: r for r in rows}


def started(**cluster):
    attempt, rows = prepared(**cluster)
    for row in rows.values():
        coordinator.accept_assignment(row.worker_id, row.job_id)
    return attempt, rows


def blames(attempt) -> dict:
    return dict(
        DispatchedJob.objects.filter(cluster_attempt_id=attempt).values_list("kind", "blame")
    )


def streak(row) -> int:
    return Worker.objects.get(pk=row.worker_id).blamed_in_row


def test_blame_names_the_seat_failures_that_blame_their_machine():
    assert [blame_for(k) for k in ("transient", "timeout", "corrupt_eval_cache", "lost")] == [
        "transient",
        "timeout",
        "corrupt_eval_cache",
        "lost",
    ]
    for kind in ("permanent", "substitute_unavailable", "inputs_unavailable", "aborted", None):
        assert blame_for(kind) is None


@pytest.mark.django_db
def test_a_rejecting_seat_is_blamed_and_its_sibling_is_not():
    attempt, rows = prepared()
    coordinator.member_rejected(rows["build"].worker_id, rows["build"].job_id, "busy")
    assert ClusterAttempt.objects.get(pk=attempt).outcome == "PrepareFailed"
    assert blames(attempt) == {"build": "rejected", "eval": None}
    assert (streak(rows["build"]), streak(rows["eval"])) == (1, 0)


@pytest.mark.django_db
def test_a_prepare_timeout_blames_the_seats_that_had_not_accepted():
    attempt, rows = prepared()
    coordinator.accept_assignment(rows["eval"].worker_id, rows["eval"].job_id)
    later = timezone.now() + timedelta(seconds=3600)
    assert coordinator.expire_overdue_prepares(later) == [attempt]
    assert blames(attempt) == {"build": "prepare_timeout", "eval": None}
    assert (streak(rows["build"]), streak(rows["eval"])) == (1, 0)


@pytest.mark.django_db
def test_a_held_member_failing_before_the_start_is_blamed_by_its_kind():
    attempt, rows = prepared()
    row = rows["eval"]
    member_report(row.worker_id, row.job_id, row.pk, "Failed", "corrupt_eval_cache")
    assert blames(attempt) == {"eval": "corrupt_eval_cache", "build": None}


@pytest.mark.django_db
def test_a_held_member_whose_hold_expired_is_not_blamed():
    attempt, rows = prepared()
    row = rows["eval"]
    member_report(row.worker_id, row.job_id, row.pk, "Failed", "aborted")
    assert ClusterAttempt.objects.get(pk=attempt).outcome == "PrepareFailed"
    assert blames(attempt) == {"eval": None, "build": None}
    assert streak(row) == 0


@pytest.mark.django_db
def test_a_transient_failure_ending_a_started_attempt_is_blamed_and_the_aborted_survivor_is_not():
    attempt, rows = started(retry_budget=1)
    failing, survivor = rows["build"], rows["eval"]
    assert member_report(failing.worker_id, failing.job_id, failing.pk, "Failed", "transient")
    # The survivor's abort, reported after the verdict, changes nothing.
    member_report(survivor.worker_id, survivor.job_id, survivor.pk, "Failed", "aborted")
    assert blames(attempt) == {"build": "transient", "eval": None}
    assert (streak(failing), streak(survivor)) == (1, 0)


@pytest.mark.django_db
def test_a_permanent_failure_is_the_jobs_fault_not_the_seats():
    attempt, rows = started(retry_budget=1)
    row = rows["build"]
    assert member_report(row.worker_id, row.job_id, row.pk, "Failed", "permanent") == "Fail"
    assert blames(attempt) == {"build": None, "eval": None}


@pytest.mark.django_db
def test_a_member_lost_with_its_worker_is_blamed_lost():
    attempt, rows = started(retry_budget=1)
    lost = rows["eval"]
    assert detach(lost.worker_id, "live")
    assert blames(attempt) == {"eval": "lost", "build": None}
    assert streak(lost) == 1


@pytest.mark.django_db
def test_a_seat_that_succeeds_starts_its_workers_streak_again():
    attempt, rows = started()
    row = rows["build"]
    Worker.objects.filter(pk=row.worker_id).update(blamed_in_row=2)
    member_report(row.worker_id, row.job_id, row.pk, "Completed")
    assert streak(row) == 0
    assert blames(attempt) == {"build": None, "eval": None}


@pytest.mark.django_db
def test_a_second_close_blames_nothing_more():
    attempt, rows = prepared()
    coordinator.member_rejected(rows["build"].worker_id, rows["build"].job_id, "busy")
    # The timeout finds the attempt closed: no seat is blamed twice, no count moves.
    later = timezone.now() + timedelta(seconds=3600)
    assert coordinator.expire_overdue_prepares(later) == []
    assert blames(attempt) == {"build": "rejected", "eval": None}
    assert (streak(rows["build"]), streak(rows["eval"])) == (1, 0)
