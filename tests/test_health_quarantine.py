"""Quarantine: decided in the transaction that closes the attempt, lifted on probation, and an
operator's until released."""

from datetime import timedelta
from functools import partial

import pytest
from django.utils import timezone

from clusters import coordinator
from clusters.claim import claim_cluster
from clusters.settlement import member_report
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import claim_for, make_cluster
from tests.concurrency import race
from tests.factories import WorkerFactory
from workers import health
from workers.models import Worker


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


@pytest.fixture(autouse=True)
def _health(settings):
    settings.GRADIENT = {**settings.GRADIENT, "QUARANTINE_AFTER": 3, "QUARANTINE_SECS": 600}


def reject_on(flaky) -> None:
    """A cluster claimed on the flaky worker and a healthy one; the flaky one rejects."""
    cluster = make_cluster()
    claim = claim_for(cluster, [flaky, WorkerFactory()])
    assert claim_cluster(claim)
    row = DispatchedJob.objects.get(cluster_attempt_id=claim.attempt_id, worker=flaky)
    coordinator.member_rejected(flaky.pk, row.job_id, "flaky")


def succeed_on(worker) -> None:
    """A cluster started on the worker and a healthy one; the worker's member completes."""
    cluster = make_cluster()
    claim = claim_for(cluster, [worker, WorkerFactory()])
    assert claim_cluster(claim)
    rows = DispatchedJob.objects.filter(cluster_attempt_id=claim.attempt_id)
    for row in rows:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    row = rows.get(worker=worker)
    member_report(worker.pk, row.job_id, row.pk, "Completed")


def state(worker) -> Worker:
    return Worker.objects.get(pk=worker.pk)


def quarantined(worker, now=None) -> bool:
    return health.is_quarantined(state(worker), now or timezone.now())


def test_quarantine_is_due_at_the_threshold_unless_in_force_or_disabled():
    assert not health.quarantine_due(2, False, 3)
    assert health.quarantine_due(3, False, 3)
    assert health.quarantine_due(4, False, 3)  # on probation
    assert not health.quarantine_due(3, True, 3)  # in force already: it keeps its end
    assert not health.quarantine_due(99, False, 0)  # GRADIENT_QUARANTINE_AFTER=0


@pytest.mark.django_db
def test_the_third_blamed_seat_in_a_row_quarantines_the_worker_automatically():
    flaky = WorkerFactory()
    reject_on(flaky)
    reject_on(flaky)
    assert not quarantined(flaky)
    reject_on(flaky)
    worker = state(flaky)
    assert health.is_quarantined(worker, timezone.now())
    assert worker.quarantined_by == "automatic"
    assert worker.quarantine_reason == "3 blamed seats in a row, the last rejected"
    assert worker.quarantined_until - worker.quarantined_since == timedelta(seconds=600)


@pytest.mark.django_db
def test_a_seat_succeeding_in_between_keeps_the_worker_out_of_quarantine():
    flaky = WorkerFactory()
    reject_on(flaky)
    reject_on(flaky)
    succeed_on(flaky)
    reject_on(flaky)
    reject_on(flaky)
    assert not quarantined(flaky)
    assert state(flaky).blamed_in_row == 2


@pytest.mark.django_db
def test_zero_disables_automatic_quarantine(settings):
    settings.GRADIENT = {**settings.GRADIENT, "QUARANTINE_AFTER": 0}
    flaky = WorkerFactory()
    for _ in range(4):
        reject_on(flaky)
    assert not quarantined(flaky)
    assert state(flaky).blamed_in_row == 4


@pytest.mark.django_db
def test_after_its_quarantine_the_next_blamed_seat_quarantines_again_at_once():
    flaky = WorkerFactory()
    for _ in range(3):
        reject_on(flaky)
    lapsed = timezone.now() + timedelta(seconds=601)
    assert not quarantined(flaky, lapsed)
    assert health.on_probation(state(flaky), lapsed)
    Worker.objects.filter(pk=flaky.pk).update(quarantined_until=timezone.now())  # lapsed
    reject_on(flaky)
    assert quarantined(flaky)


@pytest.mark.django_db
def test_a_seat_succeeding_on_probation_ends_it():
    flaky = WorkerFactory()
    for _ in range(3):
        reject_on(flaky)
    Worker.objects.filter(pk=flaky.pk).update(quarantined_until=timezone.now())
    succeed_on(flaky)
    assert not health.on_probation(state(flaky), timezone.now())
    reject_on(flaky)
    assert not quarantined(flaky)


@pytest.mark.django_db
def test_an_operators_quarantine_lasts_until_released_and_a_release_clears_the_streak():
    worker = WorkerFactory()
    health.quarantine(worker, "bad disk")
    far = timezone.now() + timedelta(days=3650)
    assert quarantined(worker, far)
    assert (state(worker).quarantined_by, state(worker).quarantine_reason) == (
        "operator",
        "bad disk",
    )
    reject_on(worker)  # a further blamed seat leaves an operator's quarantine as it is
    assert state(worker).quarantined_by == "operator"
    health.release(worker)
    assert not quarantined(worker)
    assert not health.on_probation(state(worker), timezone.now())
    assert state(worker).blamed_in_row == 0


@pytest.mark.django_db
def test_an_operators_quarantine_keeps_the_start_of_one_in_force():
    flaky = WorkerFactory()
    for _ in range(3):
        reject_on(flaky)
    since = state(flaky).quarantined_since
    health.quarantine(flaky, "looked at it")
    assert state(flaky).quarantined_since == since
    assert state(flaky).quarantined_by == "operator"


@pytest.mark.django_db(transaction=True)
def test_two_closes_blaming_one_worker_at_once_both_count():
    # Each round: two attempts on the same flaky worker, rejected by two connections at the
    # same instant, from a streak of one; both counts land, and the second quarantines it.
    for _ in range(20):
        flaky = WorkerFactory()
        Worker.objects.filter(pk=flaky.pk).update(blamed_in_row=1)
        held = []
        for _ in range(2):
            cluster = make_cluster()
            claim = claim_for(cluster, [flaky, WorkerFactory()])
            assert claim_cluster(claim)
            held.append(
                DispatchedJob.objects.get(cluster_attempt_id=claim.attempt_id, worker=flaky)
            )
        race(*(partial(coordinator.member_rejected, r.worker_id, r.job_id, "flaky") for r in held))
        assert state(flaky).blamed_in_row == 3
        assert quarantined(flaky)
