"""How many queries the hot path of a session costs: a RequestJob that assigns a single job,
one that finds nothing to give, a single job's JobCompleted, and the acceptances (the last
member's is on the gang-start latency path). Every frame of a busy fleet goes through these,
each query a round trip to PostgreSQL from daphne, so a change that adds one must show up here
(bench/throughput.py measures what they add up to)."""

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from clusters.dispatch import run_pass
from clusters.models import ClusterAttempt, ClusterStatus
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from gradient.jobs.steps import FETCH_STEPS
from sessions import reports
from tests.clusterflow import Inbox, committed, idle_workers, session_request
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
)
from workers.models import IdleSlot
from workers.offers import Offered

# Budgets, in statements (a transaction's BEGIN and COMMIT are not counted; in a test they are
# a SAVEPOINT and its RELEASE, which are).
# RequestJob that assigns: the offer, both kinds' heads read and the members new to the
# worker recorded as offered, after the setting that keeps its generic plan, in one round trip
# (a pipeline) (2); the claim of the best job no other claim holds, with the
# worker's room, the transition and the idle slot, in one statement (1). (A session answers
# after the worker's scores; counted here without that wait, the same statements.)
REQUEST_ASSIGNING = 3
# RequestJob with nothing to give, nothing new to offer: the offer, in one round trip (2); the
# idle slot in a transaction of its own, its row locked and then the room counted and the slot
# written, in one round trip (a pipeline) (2). In a test, between a SAVEPOINT and its RELEASE.
REQUEST_IDLE_STATEMENTS = 4
REQUEST_IDLE = REQUEST_IDLE_STATEMENTS + 2
# A single job's JobCompleted: one statement.
COMPLETED = 1
# A single job's AssignJobResponse (accepted): the one query that tells it from a member's.
ACCEPTED = 1
# A cluster member's AssignJobResponse (accepted), not the last: one statement
# (clusters.statements.ACCEPT_SQL) that finds the row, locks its attempt and the attempt's
# rows, and records the acceptance.
MEMBER_ACCEPTED = 1
# The last member's: the same statement also starts the attempt (the attempt, its cluster
# Running, the member evaluations' transition) and returns the roster. StartCluster then goes
# to the channel layer, not to PostgreSQL.
LAST_MEMBER_ACCEPTED = 1
# A cluster member's JobCompleted that does not decide yet (a sibling still runs): the single
# job's statement, which finishes nothing and tells it is a member's (1); the report's
# transaction (clusters.settlement.member_report): SAVEPOINT, then one round trip (a pipeline)
# of the lock_timeout, the attempt's lock, the row's finish, its worker's blamed seats in a row
# started again, and every member's state with the cluster's attempts and retry budget (5);
# RELEASE. In production BEGIN and COMMIT take the SAVEPOINT's and RELEASE's places: 4 round
# trips in all.
MEMBER_COMPLETED = 8
# One that decides Complete: the same, and settling: the attempt closed with its open rows
# abandoned and the cluster Completed (clusters.claim.close_cluster_attempt, one statement),
# then in one more round trip (a pipeline) the builds' and the evaluations' transitions (3).
# 6 round trips in all.
MEMBER_COMPLETED_DECIDING = 11
# A member's JobFailed, deciding Retry: no single job's statement first (a single's failure
# runs in the transaction the member path opens); SAVEPOINT, the report's round trip (4),
# settling's two (3), the seat blamed and counted against its worker (1), RELEASE. 6 round
# trips in all.
MEMBER_FAILED_DECIDING = 10


def counted(fn, *args):
    with CaptureQueriesContext(connection) as captured:
        result = fn(*args)
    return result, [q["sql"] for q in captured.captured_queries]


@pytest.fixture(autouse=True)
def no_wake(monkeypatch):
    """The dispatch wake-up goes to Redis, not PostgreSQL."""
    monkeypatch.setattr("sessions.request_job.wake_dispatch", lambda: True)


def queued(kind, project, **fields):
    return (EvaluationFactory if kind == "eval" else BuildFactory)(project=project, **fields)


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["eval", "build"])
def test_a_request_that_assigns_a_job(kind):
    project, worker = ProjectFactory(), WorkerFactory()
    IdleSlot.objects.create(worker=worker, kind=kind, recorded_at="2026-01-01T00:00Z")
    job = queued(kind, project)
    (offer, assign), sql = counted(session_request, worker, kind)
    assert len(sql) == REQUEST_ASSIGNING, "\n".join(sql)
    assert [j.job_id for j in offer.jobs] == [job.job_key]
    assert assign.job_id == job.job_key and assign.message.job.project == project.name
    row = DispatchedJob.objects.get()
    assert (str(row.id), row.worker_id, row.finished_at) == (
        assign.message.assignment_id,
        worker.pk,
        None,
    )
    job.refresh_from_db()
    assert job.status == ("EvaluatingFlake" if kind == "eval" else BuildStatus.BUILDING)
    assert not IdleSlot.objects.exists()


@pytest.mark.django_db
def test_a_request_with_nothing_to_give():
    worker = WorkerFactory()
    session_request(worker, "build")
    (offer, assign), sql = counted(session_request, worker, "build")
    assert (offer, assign) == (None, None)
    assert len(sql) == REQUEST_IDLE, "\n".join(sql)
    assert IdleSlot.objects.filter(worker=worker, kind="build").exists()


@pytest.mark.django_db
def test_an_offer_leaves_out_what_the_worker_was_offered_before():
    # No room for an evaluation: each request is offered the head and given nothing.
    project, worker = ProjectFactory(), WorkerFactory(max_concurrent_evals=0)
    first = queued("eval", project)
    offered = Offered()  # the session's memory of the single jobs it offered
    offer, _ = session_request(worker, "eval", offered)
    assert [j.job_id for j in offer.jobs] == [first.job_key]
    second = queued("eval", project)
    offer, _ = session_request(worker, "eval", offered)
    assert [j.job_id for j in offer.jobs] == [second.job_key]


def assigned(kind, steps=None):
    worker = WorkerFactory()
    job = queued(kind, ProjectFactory())
    _, assign = session_request(worker, kind)
    if steps is not None:
        DispatchedJob.objects.update(steps=steps)
        Evaluation.objects.filter(pk=job.pk).update(status=EvaluationStatus.FETCHING)
    return worker, job, assign


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["eval", "build"])
def test_a_single_jobs_completion_is_one_statement(kind):
    worker, job, assign = assigned(kind)
    _, sql = counted(reports.job_completed, worker.pk, assign.job_id, assign.message.assignment_id)
    assert len(sql) == COMPLETED, "\n".join(sql)
    row = DispatchedJob.objects.get()
    assert row.outcome == "Completed" and row.finished_at is not None
    job.refresh_from_db()
    assert job.status == "Completed"


@pytest.mark.django_db
def test_a_fetch_only_completion_leaves_its_evaluation_fetching():
    worker, job, assign = assigned("eval", steps=FETCH_STEPS)
    reports.job_completed(worker.pk, assign.job_id, assign.message.assignment_id)
    assert DispatchedJob.objects.get().outcome == "Completed"
    assert Evaluation.objects.get(pk=job.pk).status == EvaluationStatus.FETCHING


@pytest.mark.django_db
def test_a_completion_by_another_worker_or_under_another_assignment_changes_nothing():
    worker, job, assign = assigned("build")
    for args in [
        (WorkerFactory().pk, assign.job_id, assign.message.assignment_id),
        (worker.pk, assign.job_id, str(uuid.uuid4())),
        (worker.pk, assign.job_id, "not-a-uuid"),
    ]:
        with pytest.raises(NotAllowed):
            reports.job_completed(*args)
    assert DispatchedJob.objects.get().finished_at is None
    assert DerivationBuild.objects.get(pk=job.pk).status == BuildStatus.BUILDING
    reports.job_completed(worker.pk, assign.job_id, assign.message.assignment_id)
    with pytest.raises(NotAllowed):  # reported twice
        reports.job_completed(worker.pk, assign.job_id, assign.message.assignment_id)


@pytest.mark.django_db
def test_accepting_a_single_job_is_one_query():
    worker, _, assign = assigned("build")
    _, sql = counted(reports.job_accepted, worker.pk, assign.job_id)
    assert len(sql) == ACCEPTED, "\n".join(sql)
    with pytest.raises(NotAllowed):
        reports.job_accepted(WorkerFactory().pk, assign.job_id)


@committed
def test_a_members_acceptance_is_one_statement_and_so_is_the_last_ones_start(memory_layer):
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    workers = idle_workers(2)
    inbox = Inbox(workers)
    assert run_pass().claimed == [cluster.pk]
    for w in workers:
        inbox.frames(w)  # the AssignJobs
    build, evaluation = DispatchedJob.objects.order_by("kind")
    _, sql = counted(reports.job_accepted, evaluation.worker_id, evaluation.job_id)
    assert len(sql) == MEMBER_ACCEPTED, "\n".join(sql)
    assert ClusterAttempt.objects.get().started_at is None
    assert all(inbox.frames(w) == [] for w in workers)
    _, sql = counted(reports.job_accepted, build.worker_id, build.job_id)
    assert len(sql) == LAST_MEMBER_ACCEPTED, "\n".join(sql)
    assert ClusterAttempt.objects.get().started_at is not None
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts) == (ClusterStatus.RUNNING, 1)
    assert Evaluation.objects.get().status == EvaluationStatus.EVALUATING_FLAKE
    assert all([f["type"] for f in inbox.frames(w)] == ["StartCluster"] for w in workers)


def started_members():
    """A started attempt of a server (an evaluation) and a client (a build), neither primary:
    the rows by kind."""
    cluster = ClusterFactory(retry_budget=1)
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    idle_workers(2)
    assert run_pass().claimed == [cluster.pk]
    rows = {row.kind: row for row in DispatchedJob.objects.all()}
    for row in rows.values():
        reports.job_accepted(row.worker_id, row.job_id)
    return cluster, rows


def reported(row, *failure_kind):
    report = reports.job_failed if failure_kind else reports.job_completed
    return counted(report, row.worker_id, row.job_id, str(row.pk), *failure_kind)[1]


@committed
def test_a_members_completion_decides_or_not_in_a_few_round_trips(memory_layer):
    cluster, rows = started_members()
    sql = reported(rows["build"])
    assert len(sql) == MEMBER_COMPLETED, "\n".join(sql)
    assert DispatchedJob.objects.get(pk=rows["build"].pk).outcome == "Completed"
    assert DerivationBuild.objects.get().status == BuildStatus.BUILDING  # held back
    sql = reported(rows["eval"])
    assert len(sql) == MEMBER_COMPLETED_DECIDING, "\n".join(sql)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.COMPLETED
    assert ClusterAttempt.objects.get().outcome == "Succeeded"
    assert DerivationBuild.objects.get().status == BuildStatus.COMPLETED
    assert Evaluation.objects.get().status == EvaluationStatus.COMPLETED


@committed
def test_a_members_failure_pays_no_query_to_tell_it_from_a_single(memory_layer):
    cluster, rows = started_members()
    sql = reported(rows["build"], "transient")
    assert len(sql) == MEMBER_FAILED_DECIDING, "\n".join(sql)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.QUEUED
    assert DerivationBuild.objects.get().status == BuildStatus.QUEUED
    assert Evaluation.objects.get().status == EvaluationStatus.QUEUED
