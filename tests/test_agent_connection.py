"""The agent's connection (protocol.md, "Connection" and "The agent"): running jobs outlive a
lost session and their reports go out on the next; a token the server keeps refusing, a
certificate that does not verify and a replaced connection end the agent with their own exit
status; leftovers of a killed agent are ended by the next one."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gradient.wire import protocol as p
from tests.agent_harness import TOKEN, AgentProcess
from tests.agent_session import WORKER, connected, handshake, job
from tests.fake_server import FakeServer, build
from tests.tls import server_tls

pytestmark = pytest.mark.asyncio


async def test_a_job_runs_on_through_a_lost_connection_and_is_reported_on_the_next(tmp_path):
    async with connected(tmp_path) as (agent, first, server):
        await first.send(job(["sh", "-c", "sleep 1; echo done"]))
        await first.expect(p.AssignJobResponse)
        await agent.wait_event("started", job_id=build(1))
        first.ws.transport.abort()  # a server crash: no close frame

        second = await server.session()
        await second.expect(p.WorkerCapabilities)
        await agent.wait_event("completed", job_id=build(1))  # while no session was up
        await second.send(p.InitAck(worker=WORKER, heartbeat_secs=600))
        done = await second.expect(p.JobCompleted)
        assert (done.job_id, done.log_tail) == (build(1), "done\n")
        assert await second.expect(p.RequestJob) == p.RequestJob(kind="build")
    disconnected = agent.named("disconnected")[0]
    assert disconnected["url"] == server.url and disconnected["level"] == "warning"


async def test_a_token_the_server_keeps_refusing_ends_the_agent_with_3(tmp_path):
    async with FakeServer(status=403) as server:
        args = ("--url", server.url, "--workdir", str(tmp_path))
        async with AgentProcess(*args) as agent:
            assert await agent.exit_status(timeout=40) == 3
    assert server.handshakes == 5  # refused, then tried again four times
    fatal = agent.named("fatal")[0]
    assert fatal["reason"] == "the server kept refusing the token (HTTP 403)"
    assert fatal["level"] == "error" and fatal["exit"] == 3


async def test_a_certificate_that_does_not_verify_ends_the_agent_with_3_and_no_token_sent(
    tmp_path,
):
    tls, _ = server_tls(tmp_path)
    async with FakeServer(tls=tls) as server:
        args = ("--url", server.url, "--workdir", str(tmp_path / "work"))
        async with AgentProcess(*args) as agent:
            assert await agent.exit_status() == 3
    assert server.handshakes == 0 and server.authorizations == []
    failed = agent.named("connect_failed")[0]
    assert failed["error"].startswith("certificate: ")
    assert agent.named("fatal")[0]["reason"].startswith("the server's certificate did not verify")


async def test_a_server_verified_against_the_ca_file_gets_the_token(tmp_path):
    tls, ca_file = server_tls(tmp_path)
    async with FakeServer(tls=tls) as server:
        args = ("--url", server.url, "--ca-file", str(ca_file), "--workdir", str(tmp_path / "w"))
        async with AgentProcess(*args):
            session = await server.session()
            await handshake(session)
    assert server.authorizations == [f"Bearer {TOKEN}"]


async def test_a_replaced_connection_ends_the_agent_with_4(tmp_path):
    async with connected(tmp_path) as (agent, session, _):
        await session.ws.close(code=4409, reason="replaced")
        assert await agent.exit_status() == 4
    assert agent.named("fatal")[0]["reason"] == "another agent connected with the same token"


async def test_an_agent_starting_again_ends_what_a_killed_one_left_in_its_workdir(tmp_path):
    script = "sleep 60 & echo $! > background.pid; wait"
    async with connected(tmp_path) as (agent, session, _):
        await session.send(job(["sh", "-c", script]))
        await session.expect(p.AssignJobResponse)
        started = await agent.wait_event("started", job_id=build(1))
        pid_file = Path(started["directory"]) / "background.pid"
        async with asyncio.timeout(10):
            while not pid_file.exists() or not pid_file.read_text().strip():
                await asyncio.sleep(0.02)
        background = int(pid_file.read_text())
        os.killpg(agent.pid, signal.SIGKILL)  # the agent alone: the job has its own group
        await agent.exit_status()
    os.kill(background, 0)  # the job's first process died with the agent; this one did not

    async with connected(tmp_path) as (again, _, _):
        ended = await again.wait_event("leftover_ended")
        assert "ended 1 process" in ended["detail"]
    async with asyncio.timeout(10):
        while _running(background):
            await asyncio.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
