"""The reference worker as a cluster member: holds, starts, refusals, aborts and signals,
against a fake server on a real socket."""

import pytest

from gradient.wire import protocol as p
from tests.fake_server import ATT1, ATT2, SLOW, assign, build, fleet_of_one, hold, roster
from workers.simulator import (
    HOLD_TIMED_OUT,
    WorkerConfig,
)


@pytest.mark.asyncio
async def test_held_member_starts_only_on_start_cluster():
    async with fleet_of_one() as (worker, session):
        await session.send(assign(cluster=hold()))
        assert (await session.expect(p.AssignJobResponse)).accepted
        await session.expect_quiet(0.3)
        assert [j.job_id for j in worker.held] == [build(1)]
        assert not [e for e in worker.events if e["event"] == "started"]

        await session.send(roster())
        done = await session.expect(p.JobCompleted)
        assert done.job_id == build(1)
        started = await worker.wait_event("started", attempt=ATT1)
        assert started["roster"][0]["worker"] == "w"
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")


@pytest.mark.asyncio
async def test_hold_without_start_is_released_after_hold_secs():
    async with fleet_of_one() as (worker, session):
        await session.send(assign(cluster=hold(hold_secs=1)))
        await session.expect(p.AssignJobResponse)
        await session.expect_quiet(0.7)
        failed = await session.expect(p.JobFailed, timeout=2)
        assert (failed.kind, failed.error) == ("aborted", HOLD_TIMED_OUT)
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")
        assert (await worker.wait_event("released_hold"))["reason"] == "timeout"


@pytest.mark.asyncio
async def test_second_member_of_an_attempt_is_refused():
    config = WorkerConfig(eval=False, max_builds=2, job_secs=(0.05, 0.05))
    async with fleet_of_one(config) as (worker, session):
        await session.send(assign(build(1), cluster=hold(index=0)))
        await session.send(assign(build(2), cluster=hold(index=1)))
        first = await session.expect(p.AssignJobResponse)
        second = await session.expect(p.AssignJobResponse)
        assert first.accepted and not second.accepted
        assert second.reason == "already holding a member of this attempt"
        assert worker.rejected == 1


@pytest.mark.asyncio
async def test_member_without_free_slot_or_by_reject_rate_is_refused():
    async with fleet_of_one() as (_, session):
        await session.send(assign(build(1), cluster=hold(ATT1)))
        await session.send(assign(build(2), cluster=hold(ATT2)))
        await session.expect(p.AssignJobResponse)
        refused = await session.expect(p.AssignJobResponse)
        assert (refused.accepted, refused.reason) == (False, "no free build slot")

    picky = WorkerConfig(eval=False, job_secs=(0.05, 0.05), reject_rate=1.0)
    async with fleet_of_one(picky) as (_, session):
        await session.send(assign(build(1), cluster=hold()))
        refused = await session.expect(p.AssignJobResponse)
        assert (refused.accepted, refused.reason) == (False, "simulated reject")
        await session.send(assign(build(2)))  # reject_rate is for cluster members only
        assert (await session.expect(p.AssignJobResponse)).accepted


@pytest.mark.asyncio
async def test_abort_cluster_drops_held_member_silently_and_aborts_running_one():
    config = WorkerConfig(eval=False, max_builds=2, job_secs=SLOW)
    async with fleet_of_one(config) as (worker, session):
        await session.send(assign(build(1), cluster=hold(ATT1)))
        await session.send(assign(build(2), cluster=hold(ATT2)))
        await session.expect(p.AssignJobResponse)
        await session.expect(p.AssignJobResponse)
        await session.send(roster(ATT2))
        await worker.wait_event("started", attempt=ATT2)

        await session.send(p.AbortCluster(attempt=ATT1, reason="prepare failed"))
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")  # no report
        await session.send(p.AbortCluster(attempt=ATT2, reason="member failed"))
        failed = await session.expect(p.JobFailed)
        assert (failed.job_id, failed.kind) == (build(2), "aborted")
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")
        await session.expect_quiet()
        assert not worker.jobs


@pytest.mark.asyncio
async def test_abort_job_reports_aborted():
    async with fleet_of_one(WorkerConfig(eval=False, job_secs=SLOW)) as (_, session):
        await session.send(assign())
        await session.expect(p.AssignJobResponse)
        await session.send(p.AbortJob(job_id=build(1), reason="canceled"))
        failed = await session.expect(p.JobFailed)
        assert (failed.job_id, failed.kind) == (build(1), "aborted")
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")


@pytest.mark.asyncio
async def test_signals_are_sent_and_recorded():
    config = WorkerConfig(eval=False, job_secs=SLOW, signal_on_start=True)
    async with fleet_of_one(config) as (worker, session):
        await session.send(assign(cluster=hold(role="db", index=0)))
        await session.expect(p.AssignJobResponse)
        await session.send(roster())
        hello = await session.expect(p.ClusterSignal)
        assert (hello.attempt, hello.to) == (ATT1, None)
        assert hello.payload == {"worker": "w", "role": "db", "index": 0}

        incoming = {"attempt": ATT1, "from": {"role": "web", "index": 1}, "payload": [1, 2]}
        await session.send({"type": "ClusterSignal", **incoming})
        assert await worker.wait_event("signal_received")
        assert list(worker.signals) == [incoming]

        assert await worker.send_signal(ATT1, {"port": 5432}, to=("web", 1))
        sent = await session.expect(p.ClusterSignal)
        assert sent.to == p.MemberRef(role="web", index=1) and sent.payload == {"port": 5432}
