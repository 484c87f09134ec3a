"""The hourly retention pass: finished clusters past retentionDays go, memberless finished
ones go at once, active ones (or any with an open attempt) never do."""

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from bench import retention as bench
from clusters import retention
from clusters.abort import abort_cluster
from clusters.dispatch import run_pass
from clusters.models import (
    CLUSTER_ACTIVE,
    CLUSTER_TERMINAL,
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterStatus,
)
from clusters.retention import run_retention
from gradient.jobs.models import DispatchedJob, DispatchedOutcome, JobKind
from tests.concurrency import race, rows_locked
from tests.factories import ClusterFactory, EvalMemberFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def cluster(status, age_days=0.0, members=1, attempt="finished"):
    """A cluster last changed `age_days` ago, with `members` evaluation members and an attempt
    ("finished", "open" or None) that has a dispatched_job row per member."""
    job = ClusterFactory(status=status)
    at = timezone.now() - timedelta(days=age_days)
    for _ in range(members):
        EvalMemberFactory(cluster_job=job)
    if attempt:
        made = ClusterAttempt.objects.create(
            cluster_job=job, created_at=at, finished_at=at if attempt == "finished" else None
        )
        worker = WorkerFactory()
        for m in job.members.all():
            DispatchedJob.objects.create(
                kind=JobKind.EVAL,
                job_id=m.job_key,
                evaluation_id=m.evaluation_id,
                worker=worker,
                project_id=job.project_id,
                dispatched_at=at,
                finished_at=at,
                outcome=DispatchedOutcome.COMPLETED,
                cluster_attempt=made,
            )
    # auto_now would overwrite a saved updated_at.
    ClusterJob.objects.filter(pk=job.pk).update(updated_at=at)
    return job


def remaining(*jobs):
    return {j.pk for j in jobs if ClusterJob.objects.filter(pk=j.pk).exists()}


@pytest.fixture
def days(settings):
    settings.GRADIENT = {**settings.GRADIENT, "RETENTION_DAYS": 30}
    return 30


def test_an_old_finished_cluster_goes_with_its_members_and_attempts_keeping_dispatched_rows(days):
    jobs = [cluster(s, days + 1, members=2) for s in sorted(CLUSTER_TERMINAL)]
    attempts = list(ClusterAttempt.objects.values_list("pk", flat=True))
    dispatched = DispatchedJob.objects.filter(cluster_attempt__in=attempts)
    ids = list(dispatched.values_list("pk", flat=True))
    assert len(ids) == 6
    assert run_retention() == 3
    assert remaining(*jobs) == set()
    assert not ClusterMember.objects.exists()
    assert not ClusterAttempt.objects.exists()
    rows = DispatchedJob.objects.filter(pk__in=ids)
    assert rows.count() == 6
    assert not rows.filter(cluster_attempt__isnull=False).exists()


def test_the_output_kept_with_a_clusters_assignments_goes_with_it(days):
    """Member rows outlive their cluster as telemetry, without the job's output: its error
    and log tail go with the cluster. Those of young clusters and single jobs stay."""
    old, young = cluster(ClusterStatus.FAILED, days + 1, 2), cluster(ClusterStatus.FAILED, 1)
    DispatchedJob.objects.update(error="exit 1", log_tail="the output", blame="transient")
    single = DispatchedJob.objects.create(
        kind=JobKind.EVAL,
        job_id="eval:00000000-0000-0000-0000-000000000001",
        worker=WorkerFactory(),
        project_id=old.project_id,
        dispatched_at=timezone.now(),
        log_tail="a single job's output",
    )
    old_rows = list(DispatchedJob.objects.filter(cluster_attempt__cluster_job=old))

    assert run_retention() == 1

    assert remaining(old, young) == {young.pk}
    assert (
        list(
            DispatchedJob.objects.filter(pk__in=[r.pk for r in old_rows]).values_list(
                "cluster_attempt", "error", "log_tail", "blame", "outcome"
            )
        )
        == [(None, None, None, "transient", "Completed")] * 2
    )
    assert list(
        DispatchedJob.objects.filter(cluster_attempt__cluster_job=young).values_list(
            "error", "log_tail"
        )
    ) == [("exit 1", "the output")]
    single.refresh_from_db()
    assert single.log_tail == "a single job's output"


def test_a_young_finished_cluster_stays(days):
    young = cluster(ClusterStatus.COMPLETED, days - 1)
    assert run_retention() == 0
    assert remaining(young) == {young.pk}


def test_a_finished_cluster_without_members_goes_at_once(days):
    gc = cluster(ClusterStatus.FAILED, members=2)
    never = cluster(ClusterStatus.ABORTED, members=0, attempt=None)
    kept = cluster(ClusterStatus.COMPLETED)
    for member in gc.members.all():
        member.evaluation.delete()  # evaluation garbage collection; the member row cascades
    assert run_retention() == 2
    assert remaining(gc, never, kept) == {kept.pk}


def test_an_active_cluster_is_never_deleted_however_old(days):
    jobs = [
        cluster(ClusterStatus.QUEUED, 10 * days, attempt=None),
        cluster(ClusterStatus.QUEUED, 10 * days, members=0, attempt=None),
        cluster(ClusterStatus.RUNNING, 10 * days, attempt="open"),
        cluster(ClusterStatus.RUNNING, 10 * days, members=0),
    ]
    assert run_retention() == 0
    assert remaining(*jobs) == {j.pk for j in jobs}


def test_an_open_attempt_protects_a_cluster_marked_finished(days):
    jobs = [
        cluster(ClusterStatus.COMPLETED, days + 1, attempt="open"),
        cluster(ClusterStatus.FAILED, members=0, attempt="open"),
    ]
    assert run_retention() == 0
    assert remaining(*jobs) == {j.pk for j in jobs}


def test_zero_retention_days_disables_the_pass(settings):
    settings.GRADIENT = {**settings.GRADIENT, "RETENTION_DAYS": 0}
    jobs = [cluster(ClusterStatus.COMPLETED, 365), cluster(ClusterStatus.FAILED, members=0)]
    assert run_retention() == 0
    assert remaining(*jobs) == {j.pk for j in jobs}


def test_the_pass_works_through_many_batches(days):
    old = [cluster(ClusterStatus.COMPLETED, days + 1, attempt=None) for _ in range(7)]
    active = cluster(ClusterStatus.RUNNING, days + 1)
    assert run_retention(batch=2) == 7
    assert remaining(*old, active) == {active.pk}


# Races: every pass runs on its own connection.


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("advisory_lock", [True, False])
def test_passes_at_once_delete_each_cluster_exactly_once(days, advisory_lock, monkeypatch):
    if not advisory_lock:  # the row locks alone must keep the passes apart
        monkeypatch.setattr(retention, "try_lock", lambda cursor: True)
    old = [cluster(ClusterStatus.COMPLETED, days + 1, attempt=None) for _ in range(40)]
    active = cluster(ClusterStatus.QUEUED, days + 1)
    for _ in range(5):
        counts = race(*[lambda: run_retention(batch=3)] * 4)
        assert sum(counts) == len(old)
        assert remaining(*old, active) == {active.pk}
        old = [cluster(ClusterStatus.COMPLETED, days + 1, attempt=None) for _ in range(40)]


@pytest.mark.django_db(transaction=True)
def test_a_cluster_row_locked_elsewhere_is_skipped_not_waited_on(days):
    held, free = (cluster(ClusterStatus.COMPLETED, days + 1) for _ in range(2))
    with rows_locked(ClusterJob.objects.filter(pk=held.pk)):
        assert race(run_retention) == [1]
    assert remaining(held, free) == {held.pk}
    assert run_retention() == 1


def test_only_the_status_write_moves_a_finished_clusters_finish_time(memory_layer):
    job = cluster(ClusterStatus.QUEUED, attempt=None)
    run_pass()  # no workers: it waits, and its aging clock starts
    assert ClusterJob.objects.get(pk=job.pk).waiting_since is not None
    abort_cluster(job.pk, "not wanted")
    finished = ClusterJob.objects.get(pk=job.pk).updated_at
    run_pass()  # it stopped waiting: the pass clears its clock, on a finished row
    row = ClusterJob.objects.get(pk=job.pk)
    assert row.waiting_since is None and row.updated_at == finished


def test_at_scale_the_pass_deletes_exactly_the_finished_clusters_past_the_cutoff(days):
    now = timezone.now()
    with connection.cursor() as cursor:
        bench.populate(cursor, now - timedelta(days=days + 1), now)
    began = time.perf_counter()
    deleted = run_retention()
    print(f"\nretention pass: {deleted} clusters in {time.perf_counter() - began:.2f} s")
    assert deleted == bench.DELETED == bench.FINISHED + bench.YOUNG_GONE
    assert ClusterJob.objects.filter(status__in=CLUSTER_ACTIVE).count() == bench.ACTIVE
    kept = ClusterJob.objects.filter(status__in=CLUSTER_TERMINAL)
    assert kept.count() == kept.filter(updated_at=now).count() == bench.YOUNG
    assert ClusterMember.objects.count() == bench.ACTIVE + bench.YOUNG
    assert ClusterAttempt.objects.count() == bench.ACTIVE + bench.YOUNG
    # One row per attempt, all kept as telemetry; those of the deleted clusters' attempts
    # lost their attempt.
    assert DispatchedJob.objects.count() == bench.DELETED + bench.ACTIVE + bench.YOUNG
    assert DispatchedJob.objects.filter(cluster_attempt__isnull=True).count() == bench.DELETED


def test_the_celery_task_runs_the_pass(days):
    from clusters.tasks import retention as task

    old = cluster(ClusterStatus.ABORTED, days + 1)
    assert task.name == "clusters.retention"
    assert task.apply().get() == 1
    assert remaining(old) == set()
