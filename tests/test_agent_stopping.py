"""Stopping the agent (protocol.md, "Stopping"): SIGTERM drains and exits 0 once every report
went out; a second SIGTERM, or SIGINT, aborts the running jobs, reports them and exits; with
no server to take the reports, the agent waits a bounded time and says it lost them."""

import signal

import pytest

from gradient.wire import protocol as p
from tests.agent_session import connected, job
from tests.fake_server import build, hold

pytestmark = pytest.mark.asyncio


async def test_sigterm_drains_gives_up_held_members_lets_running_jobs_finish_and_exits_0(
    tmp_path,
):
    async with connected(tmp_path, builds=2) as (agent, session, _):
        await session.send(job(["sh", "-c", "sleep 1; echo finished"]))
        await session.send(job(["true"], n=2, cluster=hold()))
        await session.expect(p.AssignJobResponse)
        await session.expect(p.AssignJobResponse)
        await agent.wait_event("started", job_id=build(1))
        agent.signal(signal.SIGTERM)
        await session.expect(p.Draining)
        held = await session.expect(p.JobFailed)
        assert (held.job_id, held.kind, held.error) == (build(2), "aborted", "worker draining")
        await session.send(job(["true"], n=3))
        refused = await session.expect(p.AssignJobResponse)
        assert (refused.accepted, refused.reason) == (False, "draining")
        done = await session.expect(p.JobCompleted)
        assert (done.job_id, done.log_tail) == (build(1), "finished\n")
        assert await agent.exit_status() == 0
        await session.expect_quiet()  # no RequestJob while draining
    assert agent.named("exiting")[-1]["exit"] == 0


STOPS = {
    "SIGINT": [(signal.SIGINT, "SIGINT")],
    "second SIGTERM": [(signal.SIGTERM, "SIGTERM"), (signal.SIGTERM, "second SIGTERM")],
}


@pytest.mark.parametrize("stop", STOPS)
async def test_sigint_or_a_second_sigterm_aborts_the_running_jobs_reports_them_and_exits(
    tmp_path, stop
):
    async with connected(tmp_path, "--kill-grace", "5") as (agent, session, _):
        await session.send(job(["sleep", "60"]))
        await session.expect(p.AssignJobResponse)
        await agent.wait_event("started", job_id=build(1))
        for sig, logged in STOPS[stop]:
            agent.signal(sig)
            await agent.wait_event("stop_requested", signal=logged)
        await session.expect(p.Draining)
        failed = await session.expect(p.JobFailed)
        assert (failed.job_id, failed.kind) == (build(1), "aborted")
        assert failed.error == "worker interrupted"
        assert await agent.exit_status() == 0


async def test_interrupted_without_a_server_it_waits_a_bounded_time_then_exits_1(tmp_path):
    async with connected(tmp_path, "--kill-grace", "0") as (agent, session, server):
        await session.send(job(["sleep", "60"]))
        await session.expect(p.AssignJobResponse)
        await agent.wait_event("started", job_id=build(1))
        server.server.close()  # the server goes, for good
        session.ws.transport.abort()
        await agent.wait_event("disconnected")
        agent.signal(signal.SIGINT)
        assert await agent.exit_status(timeout=30) == 1
    assert agent.named("failed")[0]["kind"] == "aborted"
    assert agent.named("exiting")[-1] == agent.named("exiting")[-1] | {
        "unsent_reports": 1,
        "exit": 1,
    }
