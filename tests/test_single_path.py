"""The single path over the head of the queue (workers.assignment, protocol.md): the cheapest
single job of the worker's head, unscored the most expensive, ties to the older; a job first in
line passed over by a window of younger ones goes first. The scores are the worker's answers
as its session keeps them (workers.offers.Offered)."""

import pytest

from gradient.jobs.models import DerivationBuild, DispatchedJob
from tests.concurrency import race, rows_locked
from tests.factories import BuildFactory, ProjectFactory, WorkerFactory
from workers.assignment import request_job

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small_window(settings):
    settings.GRADIENT = {**settings.GRADIENT, "OFFER_WINDOW": 4}


def queue(n, project=None):
    project = project or ProjectFactory()
    jobs = [BuildFactory(project=project) for _ in range(n)]
    return sorted(jobs, key=lambda j: j.created_at)


def given(worker, sizes=None) -> str:
    assign = request_job(worker.pk, "build", sizes=sizes).assign
    assert assign is not None
    # The worker runs it and is free again for the next request.
    DispatchedJob.objects.filter(job_id=assign.job_id).update(finished_at="2026-01-01T00:00Z")
    return assign.job_id


def test_the_cheapest_job_of_the_head_is_given_unscored_ones_last_ties_to_the_older():
    worker = WorkerFactory()
    oldest, tied_old, tied_young, cheap = queue(4)
    sizes = {tied_old.job_key: 50, tied_young.job_key: 50, cheap.job_key: 10}
    assert [given(worker, sizes) for _ in range(4)] == [
        cheap.job_key,
        tied_old.job_key,
        tied_young.job_key,
        oldest.job_key,  # never scored: the most expensive
    ]


def test_a_cheaper_job_behind_the_head_waits_its_turn():
    worker = WorkerFactory()
    jobs = queue(6)
    sizes = {jobs[5].job_key: 0} | {j.job_key: 90 for j in jobs[:5]}
    assert given(worker, sizes) == jobs[0].job_key  # jobs[5] is not among the first 4


def test_the_oldest_job_is_given_out_within_a_window_of_assignments_whatever_its_closure():
    """A job whose closure every worker lacks would wait behind every cheaper one; once a
    window of younger jobs has gone ahead of it, it goes first."""
    workers = WorkerFactory.create_batch(3)
    project = ProjectFactory()
    huge = queue(1, project)[0]
    sizes = {huge.job_key: 10**12}  # alike for every worker
    order = []
    for i in range(12):
        sizes[BuildFactory(project=project).job_key] = 1
        order.append(given(workers[i % 3], sizes))
        if huge.job_key in order:
            break
    assert huge.job_key in order, order
    assert order.index(huge.job_key) == 4  # after exactly a window (4) of younger jobs


def test_a_prioritized_job_goes_before_a_cheaper_one():
    worker = WorkerFactory()
    cheap, urgent = queue(2)
    DerivationBuild.objects.filter(pk=urgent.pk).update(prioritized=True)
    assert given(worker, {cheap.job_key: 0, urgent.job_key: 99}) == urgent.job_key


@pytest.mark.django_db(transaction=True)
def test_workers_racing_for_one_head_each_get_a_job_of_their_own():
    """Workers that score alike all prefer the same job: each claim locks its job row, and
    the others pass over it to the next, so every worker is served and no job twice."""
    workers = WorkerFactory.create_batch(8)
    jobs = queue(8)
    for _ in range(20):
        given_now = race(*[lambda w=w: request_job(w.pk, "build").assign for w in workers])
        assert all(given_now), given_now
        keys = [a.job_id for a in given_now]
        assert sorted(keys) == sorted(j.job_key for j in jobs)
        DispatchedJob.objects.all().delete()
        DerivationBuild.objects.update(status="Queued")


@pytest.mark.django_db(transaction=True)
def test_a_claim_passes_over_a_job_another_transaction_holds():
    worker = WorkerFactory()
    held, free = queue(2)
    with rows_locked(DerivationBuild.objects.filter(pk=held.pk)):
        assert request_job(worker.pk, "build").assign.job_id == free.job_key


def test_a_request_is_answered_with_its_read_unless_the_head_has_jobs_to_score(monkeypatch):
    """sessions.request_job.read_and_answer: one call when nothing new is offered; with new
    jobs, the offer alone, and the answer waits for their scores."""
    from sessions import request_job as answering
    from workers.models import IdleSlot
    from workers.offers import Offered

    monkeypatch.setattr(answering, "wake_dispatch", lambda: None)
    worker = WorkerFactory()
    offered = Offered()
    head, answered, assign = answering.read_and_answer(worker, offered, "build")
    assert head.offer is None and answered and assign is None
    assert IdleSlot.objects.filter(worker=worker, kind="build").exists()
    job = BuildFactory()
    head, answered, assign = answering.read_and_answer(worker, offered, "build", resend=True)
    assert [j.job_id for j in head.offer.jobs] == [f"build:{job.pk}"]
    assert not answered and assign is None
    assert not DispatchedJob.objects.exists()
    head, answered, assign = answering.read_and_answer(worker, offered, "build", resend=True)
    assert head.offer is None and answered and assign.job_id == f"build:{job.pk}"
    assert not IdleSlot.objects.filter(worker=worker).exists()
