"""/metrics folds finished clusters into the tally: a scrape reads the tally and the untallied
clusters alone, and every cluster is counted once, whichever process folds it."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.retention import run_retention
from gradient import metrics
from tests.concurrency import frozen_connection, race
from tests.factories import ClusterFactory
from tests.test_reservation import until_waiting_on


def scrape() -> dict:
    response = Client().get("/metrics")
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }


def figures(samples) -> dict:
    """What the rows and the tally count together: the clusters gauge, the counters, the
    histograms."""
    names = ("gradient_clusters", "gradient_cluster_")
    return {k: v for k, v in samples.items() if k[0].startswith(names)}


def finished_cluster(status=ClusterStatus.COMPLETED, outcome=AttemptOutcome.SUCCEEDED, open_=False):
    cluster = ClusterFactory(status=status)
    at = timezone.now() - timedelta(minutes=5)
    ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=at,
        started_at=at + timedelta(seconds=2),
        finished_at=None if open_ else at + timedelta(minutes=1),
        outcome=None if open_ else outcome,
    )
    return cluster


def completed(samples) -> float:
    return samples[("gradient_clusters", (("status", "Completed"),))]


def succeeded(samples) -> float:
    return samples[("gradient_cluster_attempts_total", (("outcome", "Succeeded"),))]


def drain(batch):
    def run():
        folded = 0
        while n := metrics.fold(batch):
            folded += n
        return folded

    return run


@pytest.mark.django_db(transaction=True)
def test_two_processes_folding_at_once_tally_each_finished_cluster_once():
    for _ in range(40):
        finished_cluster()
    ClusterFactory(status=ClusterStatus.QUEUED)

    assert sum(race(drain(3), drain(3))) == 40

    assert not ClusterJob.objects.filter(status=ClusterStatus.COMPLETED, tallied=False).exists()
    samples = scrape()
    assert completed(samples) == 40
    assert samples[("gradient_clusters", (("status", "Queued"),))] == 1
    assert succeeded(samples) == 40
    assert samples[("gradient_cluster_queued_to_started_seconds_count", ())] == 40


def unfolded_scrape(monkeypatch) -> dict:
    """A scrape that folds nothing: every figure from the rows."""
    with monkeypatch.context() as patched:
        patched.setattr(metrics, "fold", lambda batch=0: 0)
        return scrape()


@pytest.mark.django_db(transaction=True)
def test_a_scrape_counts_the_same_before_and_after_another_process_folds(monkeypatch):
    finished_cluster()
    finished_cluster(ClusterStatus.FAILED, AttemptOutcome.FAILED)
    finished_cluster(ClusterStatus.RUNNING, open_=True)
    before = figures(unfolded_scrape(monkeypatch))

    assert race(drain(1)) == [2]  # the running one stays untallied

    assert figures(scrape()) == pytest.approx(before)


GATE = 48  # advisory lock key a gated scrape waits on


def gated_scrape_read():
    """The scrape's statement, made to wait on GATE halfway, in its read of the tally: on this
    connection alone, a temporary view that waits shadows the table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION pg_temp.gate() RETURNS boolean STABLE LANGUAGE plpgsql AS"
            f" $$BEGIN PERFORM pg_advisory_xact_lock_shared({GATE}); RETURN true; END$$"
        )
        cursor.execute(
            "CREATE TEMP VIEW cluster_metric_tally AS"
            " SELECT * FROM public.cluster_metric_tally WHERE pg_temp.gate()"
        )
    tally, by_status, *_ = metrics._read(metrics.SCRAPE_SQL)
    return tally, by_status


@pytest.mark.django_db(transaction=True)
def test_a_fold_another_process_commits_during_a_scrape_is_counted_once():
    finished_cluster()
    gate = frozen_connection()
    gate.execute("SELECT pg_advisory_lock(%s)", [GATE])

    def fold_meanwhile():
        until_waiting_on(GATE)  # the scrape's statement has begun
        folded = metrics.fold()
        gate.close()
        return folded

    read, folded = race(gated_scrape_read, fold_meanwhile)

    assert folded == 1
    # Counted by the rows, not by the tally, in the statement's snapshot: once.
    assert read == ([], [("Completed", 1)])
    assert scrape()[("gradient_clusters", (("status", "Completed"),))] == 1


@pytest.mark.django_db
def test_a_scrape_no_longer_reads_the_rows_of_a_tallied_cluster():
    cluster = finished_cluster()
    before = figures(scrape())  # this scrape folds it
    assert ClusterJob.objects.get(pk=cluster.pk).tallied
    with connection.cursor() as cursor:  # behind the tally's back: the scrape must not notice
        cursor.execute("DELETE FROM cluster_attempt WHERE cluster_job_id = %s", [cluster.pk])
    assert figures(scrape()) == pytest.approx(before)
    assert succeeded(before) == 1


@pytest.mark.django_db
def test_a_finished_cluster_with_an_open_attempt_is_not_folded():
    cluster = finished_cluster(open_=True)
    assert metrics.fold() == 0
    samples = scrape()
    assert not ClusterJob.objects.get(pk=cluster.pk).tallied
    assert samples[("gradient_cluster_attempts_open", (("phase", "started"),))] == 1
    assert completed(samples) == 1


@pytest.mark.django_db
def test_retention_takes_a_tallied_cluster_off_the_gauge_and_keeps_every_count(
    settings, monkeypatch
):
    settings.GRADIENT = {**settings.GRADIENT, "RETENTION_DAYS": 1}
    folded, unfolded = finished_cluster(), finished_cluster()
    assert metrics.fold(batch=1) == 1  # the first alone
    assert ClusterJob.objects.get(pk=folded.pk).tallied
    before = unfolded_scrape(monkeypatch)
    old = timezone.now() - timedelta(days=2)
    ClusterJob.objects.filter(pk__in=[folded.pk, unfolded.pk]).update(updated_at=old)

    assert run_retention() == 2

    after = scrape()
    assert (completed(before), completed(after)) == (2, 0)
    assert succeeded(after) == succeeded(before) == 2
