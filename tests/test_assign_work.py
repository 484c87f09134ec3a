"""An AssignJob carries its job's command, env and timeout_secs (protocol.md, "Running real
work"), on the single path and for a cluster's members, read for the jobs claimed alone."""

import pytest
from django.db.backends.utils import CursorWrapper

from clusters.dispatch import run_pass
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import Inbox, committed, idle_workers, session_request
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    waiting,
)
from workers.assignment import request_job

pytestmark = pytest.mark.django_db

WORK = {
    "command": ["pytest", "-x", "--db=$PGHOST"],
    "env": {"PGHOST": "db.internal", "EMPTY": ""},
    "timeout_secs": 1800,
}
NO_WORK = {"command": None, "env": {}, "timeout_secs": None}


def work_of(frame: dict) -> dict:
    return {k: frame["job"][k] for k in ("command", "env", "timeout_secs")}


@pytest.mark.parametrize("kind", ["eval", "build"])
def test_a_single_jobs_assignment_carries_its_work(kind):
    factory = EvaluationFactory if kind == "eval" else BuildFactory
    job = factory(project=ProjectFactory(), **WORK)
    assign = request_job(WorkerFactory().pk, kind).assign
    assert assign.job_id == job.job_key
    assert work_of(assign.message.model_dump()) == WORK
    assert assign.message.job.command == WORK["command"]


def test_a_single_job_without_work_is_assigned_with_none():
    BuildFactory(project=ProjectFactory())
    assign = request_job(WorkerFactory().pk, "build").assign
    assert '"command":null,"env":{},"timeout_secs":null' in assign.frame()


def test_of_two_candidates_the_assignment_carries_the_claimed_ones_work():
    """The single path claims among the head's jobs: the frame holds the work of the one it
    took, not of another candidate."""
    project = ProjectFactory()
    first = BuildFactory(project=project, command=["first"])
    BuildFactory(project=project, command=["second"])
    worker = WorkerFactory()
    assign = request_job(worker.pk, "build").assign
    assert (assign.job_id, assign.message.job.command) == (first.job_key, ["first"])
    DispatchedJob.objects.update(finished_at="2026-01-01T00:00Z")
    assert request_job(worker.pk, "build").assign.message.job.command == ["second"]


@committed
def test_each_member_of_a_claimed_cluster_is_assigned_its_own_work(memory_layer):
    cluster = ClusterFactory()
    EvalMemberFactory(
        cluster_job=cluster,
        role="server",
        evaluation__command=["server", "--port=9000"],
        evaluation__env={"PORT": "9000"},
        evaluation__timeout_secs=60,
    )
    BuildMemberFactory(cluster_job=cluster, role="client", derivation_build__command=["client"])
    workers = idle_workers(2)
    inbox = Inbox(workers)

    assert run_pass().claimed == [cluster.pk]

    frames = {f["cluster"]["role"]: f for w in workers for f in inbox.frames(w)}
    assert work_of(frames["server"]) == {
        "command": ["server", "--port=9000"],
        "env": {"PORT": "9000"},
        "timeout_secs": 60,
    }
    assert work_of(frames["client"]) == {"command": ["client"], "env": {}, "timeout_secs": None}


@committed
def test_a_member_without_work_is_assigned_with_none(memory_layer):
    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster)
    [worker] = idle_workers(1)
    inbox = Inbox([worker])
    assert run_pass().claimed == [cluster.pk]
    [frame] = inbox.frames(worker)
    assert work_of(frame) == NO_WORK


@pytest.fixture
def statements(monkeypatch) -> list[str]:
    """Every statement run from here on, on any thread's connection: the dispatch pass claims
    on threads of its own."""
    seen: list[str] = []
    execute = CursorWrapper._execute

    def recorded(cursor, sql, params, *args):
        seen.append(sql)
        return execute(cursor, sql, params, *args)

    monkeypatch.setattr(CursorWrapper, "_execute", recorded)
    return seen


@committed
def test_only_the_claims_read_the_work(memory_layer, statements):
    """The head (read for every RequestJob and offer), the cluster book and the planner's
    reads (every pass) carry no work column: only the claim statements do, for the jobs they
    took."""
    project = ProjectFactory()
    single = BuildFactory(project=project, command=["x" * 60_000])
    cluster = ClusterFactory(project=project)
    waiting(BuildMemberFactory(cluster_job=cluster, derivation_build__command=["y" * 60_000]))
    worker = WorkerFactory()
    [seat] = idle_workers(1, kinds=("build",))
    statements.clear()
    offer, assign = session_request(worker, "build")
    assert run_pass().claimed == [cluster.pk]
    reading = [sql for sql in statements if "command" in sql]
    assert assign.job_id == single.job_key
    assert {j.job_id for j in offer.jobs} == {single.job_key, cluster.members.get().job_key}
    assert len(reading) == 2  # the single claim, the cluster claim
    assert all("INSERT INTO dispatched_job" in sql for sql in reading)
    assert DispatchedJob.objects.get(worker=seat).job_id == cluster.members.get().job_key
