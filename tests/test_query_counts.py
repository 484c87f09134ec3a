"""How many queries the hot path of a session costs: a RequestJob that assigns a single job,
one that finds nothing to give, and a single job's JobCompleted. Every frame of a busy fleet
goes through these, each query a round trip to PostgreSQL from daphne, so a change that adds
one must show up here (bench/throughput.py measures what they add up to)."""

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from tests.factories import BuildFactory, EvaluationFactory, ProjectFactory, WorkerFactory
from workers import reports
from workers.assignment import FETCH_STEPS
from workers.consumer import answer_request
from workers.models import IdleSlot

# Budgets, in statements (a transaction's BEGIN and COMMIT are not counted; in a test they are
# a SAVEPOINT and its RELEASE, which are).
# RequestJob that assigns: the worker with its open count and reservation (1); the offer:
# both kinds' unoffered jobs, remembered as offered (1); the candidates (1); the claim in one
# transaction: SAVEPOINT, claim, transition, idle slot, RELEASE (5).
REQUEST_ASSIGNING = 8
# RequestJob with nothing to give, nothing new to offer: the worker (1), the offer (1), the
# candidates (1), the idle slot (1).
REQUEST_IDLE = 4
# A single job's JobCompleted: one statement.
COMPLETED = 1
# A single job's AssignJobResponse (accepted): the one query that tells it from a member's.
ACCEPTED = 1


def counted(fn, *args):
    with CaptureQueriesContext(connection) as captured:
        result = fn(*args)
    return result, [q["sql"] for q in captured.captured_queries]


@pytest.fixture(autouse=True)
def no_wake(monkeypatch):
    """The dispatch wake-up goes to Redis, not PostgreSQL."""
    monkeypatch.setattr("workers.consumer.wake_dispatch", lambda: True)


def queued(kind, project, **fields):
    return (EvaluationFactory if kind == "eval" else BuildFactory)(project=project, **fields)


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["eval", "build"])
def test_a_request_that_assigns_a_job(kind):
    project, worker = ProjectFactory(), WorkerFactory()
    IdleSlot.objects.create(worker=worker, kind=kind, recorded_at="2026-01-01T00:00Z")
    job = queued(kind, project)
    (offer, assign), sql = counted(answer_request, worker.pk, kind)
    assert len(sql) == REQUEST_ASSIGNING, "\n".join(sql)
    assert [j.job_id for j in offer.jobs] == [job.job_key]
    assert assign.job_id == job.job_key and assign.job.project == project.name
    row = DispatchedJob.objects.get()
    assert (str(row.id), row.worker_id, row.finished_at) == (assign.assignment_id, worker.pk, None)
    job.refresh_from_db()
    assert job.status == ("EvaluatingFlake" if kind == "eval" else BuildStatus.BUILDING)
    assert not IdleSlot.objects.exists()


@pytest.mark.django_db
def test_a_request_with_nothing_to_give():
    worker = WorkerFactory()
    answer_request(worker.pk, "build")
    (offer, assign), sql = counted(answer_request, worker.pk, "build")
    assert (offer, assign) == (None, None)
    assert len(sql) == REQUEST_IDLE, "\n".join(sql)
    assert IdleSlot.objects.filter(worker=worker, kind="build").exists()


@pytest.mark.django_db
def test_an_offer_leaves_out_what_the_worker_was_offered_before():
    project, worker = ProjectFactory(), WorkerFactory()
    first = queued("build", project)
    offer, _ = answer_request(worker.pk, "eval")  # eval: the build stays queued
    assert [j.job_id for j in offer.jobs] == [first.job_key]
    second = queued("build", project)
    offer, _ = answer_request(worker.pk, "eval")
    assert [j.job_id for j in offer.jobs] == [second.job_key]


def assigned(kind, steps=None):
    worker = WorkerFactory()
    job = queued(kind, ProjectFactory())
    _, assign = answer_request(worker.pk, kind)
    if steps is not None:
        DispatchedJob.objects.update(steps=steps)
        Evaluation.objects.filter(pk=job.pk).update(status=EvaluationStatus.FETCHING)
    return worker, job, assign


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["eval", "build"])
def test_a_single_jobs_completion_is_one_statement(kind):
    worker, job, assign = assigned(kind)
    _, sql = counted(reports.job_completed, worker.pk, assign.job_id, assign.assignment_id)
    assert len(sql) == COMPLETED, "\n".join(sql)
    row = DispatchedJob.objects.get()
    assert row.outcome == "Completed" and row.finished_at is not None
    job.refresh_from_db()
    assert job.status == "Completed"


@pytest.mark.django_db
def test_a_fetch_only_completion_leaves_its_evaluation_fetching():
    worker, job, assign = assigned("eval", steps=FETCH_STEPS)
    reports.job_completed(worker.pk, assign.job_id, assign.assignment_id)
    assert DispatchedJob.objects.get().outcome == "Completed"
    assert Evaluation.objects.get(pk=job.pk).status == EvaluationStatus.FETCHING


@pytest.mark.django_db
def test_a_completion_by_another_worker_or_under_another_assignment_changes_nothing():
    worker, job, assign = assigned("build")
    for args in [
        (WorkerFactory().pk, assign.job_id, assign.assignment_id),
        (worker.pk, assign.job_id, str(uuid.uuid4())),
        (worker.pk, assign.job_id, "not-a-uuid"),
    ]:
        with pytest.raises(NotAllowed):
            reports.job_completed(*args)
    assert DispatchedJob.objects.get().finished_at is None
    assert DerivationBuild.objects.get(pk=job.pk).status == BuildStatus.BUILDING
    reports.job_completed(worker.pk, assign.job_id, assign.assignment_id)
    with pytest.raises(NotAllowed):  # reported twice
        reports.job_completed(worker.pk, assign.job_id, assign.assignment_id)


@pytest.mark.django_db
def test_accepting_a_single_job_is_one_query():
    worker, _, assign = assigned("build")
    _, sql = counted(reports.job_accepted, worker.pk, assign.job_id)
    assert len(sql) == ACCEPTED, "\n".join(sql)
    with pytest.raises(NotAllowed):
        reports.job_accepted(WorkerFactory().pk, assign.job_id)
