"""The /proto session's reports on work held: completed, failed (requeued or ended),
rejected, abandoned by a disconnect, and the reports and signals it is not allowed."""

import asyncio

import pytest

from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from tests.factories import BuildFactory
from tests.sessions.session_db import q, snapshot
from workers.models import IdleSlot, Worker

pytestmark = pytest.mark.asyncio


async def handled(check, timeout=5.0):
    """Whether a database check holds within the timeout: the frame it shows was handled."""
    for _ in range(int(timeout / 0.05)):
        if await q(check):
            return True
        await asyncio.sleep(0.05)
    return await q(check)


def outcome_and_status():
    """The one assignment's outcome and its build's status."""
    return DispatchedJob.objects.get().outcome, DerivationBuild.objects.get().status


async def assigned_build(session):
    await session.connect()
    await session.hello()
    await session.send({"type": "RequestJob", "kind": "build"})
    return await session.recv_type("AssignJob")


async def test_a_completed_job_finishes_its_row_and_its_build(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {
            "type": "JobCompleted",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "elapsed_ms": 5,
        }
    )
    assert await handled(lambda: DerivationBuild.objects.get().status == BuildStatus.COMPLETED)
    row = await q(lambda: DispatchedJob.objects.get())
    assert row.outcome == "Completed" and row.finished_at is not None
    await session.close()


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("transient", BuildStatus.QUEUED),
        ("timeout", BuildStatus.QUEUED),
        ("permanent", BuildStatus.FAILED_PERMANENT),
        ("aborted", BuildStatus.ABORTED),
    ],
)
async def test_a_failed_build_requeues_or_ends_by_its_failure_kind(worker_session, kind, status):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {
            "type": "JobFailed",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "error": "boom",
            "kind": kind,
        }
    )
    assert await handled(lambda: outcome_and_status() == ("Failed", status))
    await session.close()


async def test_requeueing_failures_turn_permanent_when_attempts_run_out(worker_session, settings):
    settings.GRADIENT = {**settings.GRADIENT, "MAX_JOB_ATTEMPTS": 2}
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await session.connect()
    await session.hello()
    for _ in range(2):
        await session.send({"type": "RequestJob", "kind": "build"})
        job = await session.recv_type("AssignJob")
        await session.send(
            {
                "type": "JobFailed",
                "job_id": job["job_id"],
                "assignment_id": job["assignment_id"],
                "error": "flaky",
                "kind": "transient",
            }
        )
    assert await handled(
        lambda: DerivationBuild.objects.get().status == BuildStatus.FAILED_PERMANENT
    )
    await session.close()


async def test_a_report_for_a_job_the_worker_does_not_hold_is_not_allowed(worker_session):
    _, session = await worker_session()
    _, other = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(other)
    await session.connect()
    await session.hello()
    before = await q(snapshot)
    await session.send(
        {
            "type": "JobCompleted",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "elapsed_ms": 1,
        }
    )
    error = await session.recv_type("Error")
    assert error["code"] == "not_allowed"
    assert await q(snapshot) == before
    await session.close()
    await other.close()


async def test_a_rejected_assignment_goes_back_to_the_queue(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {"type": "AssignJobResponse", "job_id": job["job_id"], "accepted": False, "reason": "no"}
    )
    assert await handled(lambda: outcome_and_status() == ("Abandoned", BuildStatus.QUEUED))
    await session.close()


async def test_a_disconnect_abandons_single_assignments_and_requeues_their_jobs(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    await assigned_build(session)
    await session.send({"type": "RequestJob", "kind": "eval"})
    assert await handled(lambda: IdleSlot.objects.filter(kind="eval").exists())
    await session.close()
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Abandoned"
    assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.QUEUED
    assert not await q(lambda: IdleSlot.objects.exists())
    assert await q(lambda: Worker.objects.get().channel_name) is None


async def test_a_signal_outside_a_started_attempt_is_not_allowed(worker_session):
    _, session = await worker_session()
    await session.connect()
    await session.hello()
    await session.send(
        {
            "type": "ClusterSignal",
            "attempt": "0b6c7c5e-52a1-4b7c-9d43-8a1c3f1c0f11",
            "to": None,
            "payload": {"x": 1},
        }
    )
    assert (await session.recv_type("Error"))["code"] == "not_allowed"
    await session.close()


async def test_a_reports_error_and_log_tail_are_kept_with_its_assignment(worker_session):
    _, session = await worker_session()
    await q(lambda: BuildFactory())
    job = await assigned_build(session)
    await session.send(
        {
            "type": "JobFailed",
            "job_id": job["job_id"],
            "assignment_id": job["assignment_id"],
            "error": "exit status 3",
            "kind": "permanent",
            "log_tail": "compiling\nerror: no space left\n",
        }
    )
    row = await until_finished(job["assignment_id"])
    assert (row.failure_kind, row.error, row.log_tail) == (
        "permanent",
        "exit status 3",
        "compiling\nerror: no space left\n",
    )
    await session.close()


async def until_finished(assignment_id, timeout=5.0) -> DispatchedJob:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        row = await q(lambda: DispatchedJob.objects.get(pk=assignment_id))
        if row.finished_at is not None:
            return row
        assert asyncio.get_running_loop().time() < deadline, "the report was never recorded"
        await asyncio.sleep(0.02)
