"""What a report says of a run, kept with its assignment (dispatched_job): a JobFailed's kind
and error, and the end of the job's output (log_tail, its last 64 KiB); show_log prints it."""

import uuid

import pytest

from clusters.models import ClusterStatus
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from gradient.wire.protocol import MAX_LOG_TAIL_BYTES
from sessions import reports
from tests.aborting import running_cluster, statuses
from tests.clusterflow import committed
from tests.commands import run
from tests.factories import BuildFactory, ProjectFactory, WorkerFactory
from tests.test_commands_refusals import refusal, table_contents
from workers.assignment import request_job

pytestmark = pytest.mark.django_db

LONG = "first line\n" + "é" * MAX_LOG_TAIL_BYTES + "\nlast line"


def single_assigned():
    BuildFactory(project=ProjectFactory())
    worker = WorkerFactory(name="w1")
    assign = request_job(worker.pk, "build").assign
    return worker, assign.job_id, assign.message.assignment_id


def kept(assignment_id) -> tuple:
    return DispatchedJob.objects.values_list("outcome", "failure_kind", "error", "log_tail").get(
        pk=assignment_id
    )


def test_a_single_jobs_completion_keeps_its_log_tail():
    worker, job_id, assignment = single_assigned()
    reports.job_completed(worker.pk, job_id, assignment, "built\nok\n")
    assert kept(assignment) == ("Completed", None, None, "built\nok\n")
    assert DerivationBuild.objects.get().status == BuildStatus.COMPLETED


def test_a_single_jobs_failure_keeps_its_kind_error_and_log_tail():
    worker, job_id, assignment = single_assigned()
    reports.job_failed(worker.pk, job_id, assignment, "permanent", "exit status 2", "boom\n")
    assert kept(assignment) == ("Failed", "permanent", "exit status 2", "boom\n")


def test_a_report_without_output_keeps_none():
    worker, job_id, assignment = single_assigned()
    reports.job_completed(worker.pk, job_id, assignment)
    assert kept(assignment) == ("Completed", None, None, None)


def test_a_long_log_tail_is_kept_cut_at_its_start_to_the_limit():
    worker, job_id, assignment = single_assigned()
    reports.job_failed(worker.pk, job_id, assignment, "transient", "e" * 5000, LONG)
    *_, error, log_tail = kept(assignment)
    assert log_tail.endswith("é\nlast line") and "first line" not in log_tail
    assert LONG.endswith(log_tail)
    assert MAX_LOG_TAIL_BYTES - 1 <= len(log_tail.encode()) <= MAX_LOG_TAIL_BYTES
    assert error == "e" * 4096


def test_a_refused_report_keeps_nothing():
    _, job_id, assignment = single_assigned()
    other = WorkerFactory()
    with pytest.raises(NotAllowed):
        reports.job_completed(other.pk, job_id, assignment, "not mine")
    assert kept(assignment) == (None, None, None, None)


@committed
def test_a_members_reports_keep_their_output_as_they_settle(memory_layer):
    cluster, rows, _, _ = running_cluster(retry_budget=1)  # the evaluation is primary
    client, server = rows["build"], rows["eval"]
    reports.job_completed(client.worker_id, client.job_id, str(client.pk), "ran 12 tests")
    reports.job_failed(
        server.worker_id,
        server.job_id,
        str(server.pk),
        "transient",
        "connection refused",
        "server: retrying\n" * 3,
    )
    assert statuses(cluster)[0] == ClusterStatus.QUEUED  # retried
    assert kept(client.pk) == ("Completed", None, None, "ran 12 tests")
    assert kept(server.pk) == (
        "Failed",
        "transient",
        "connection refused",
        "server: retrying\n" * 3,
    )


@committed
def test_a_survivors_report_after_the_verdict_keeps_its_output_and_changes_nothing_else(
    memory_layer,
):
    """The verdict abandons a member still running and tells its worker AbortCluster; the
    worker then reports it aborted, with the output that shows how it ended."""
    cluster, rows, _, _ = running_cluster()
    reports.job_failed(
        rows["build"].worker_id, rows["build"].job_id, str(rows["build"].pk), "permanent", "x"
    )
    before = statuses(cluster)
    survivor = rows["eval"]
    assert kept(survivor.pk) == ("Abandoned", None, None, None)

    reports.job_failed(
        survivor.worker_id, survivor.job_id, str(survivor.pk), "aborted", "aborted", "server\n"
    )

    assert kept(survivor.pk) == ("Abandoned", None, "aborted", "server\n")
    assert statuses(cluster) == before
    # A second late report keeps what the first brought.
    reports.job_completed(survivor.worker_id, survivor.job_id, str(survivor.pk), "again")
    assert kept(survivor.pk) == ("Abandoned", None, "aborted", "server\n")


def test_show_log_prints_an_assignments_log_tail():
    worker, job_id, assignment = single_assigned()
    assert run("show_log", assignment) == {
        "assignment_id": assignment,
        "job_id": job_id,
        "worker": "w1",
        "outcome": None,
        "log_tail": None,
    }
    reports.job_failed(worker.pk, job_id, assignment, "permanent", "exit 1", LONG)
    shown = run("show_log", assignment.upper())  # any spelling of the UUID
    assert (shown["assignment_id"], shown["outcome"]) == (assignment, "Failed")
    assert shown["log_tail"] == kept(assignment)[3] and shown["log_tail"].endswith("last line")


@pytest.mark.parametrize(
    ("argument", "error"),
    [
        ("not-a-uuid", "assignment id 'not-a-uuid' is not a UUID"),
        ("", "assignment id '' is not a UUID"),
        (str(uuid.UUID(int=7)), f"unknown assignment {uuid.UUID(int=7)}"),
    ],
)
def test_show_log_of_an_unknown_or_malformed_id_is_refused_in_one_line(argument, error):
    single_assigned()
    before = table_contents()
    assert refusal("show_log", argument) == error
    assert table_contents() == before
