"""The reference worker when things go wrong: error frames, reports it could never make,
draining, refused handshakes, replaced and dropped connections, several servers."""

import asyncio
import time
from dataclasses import replace

import pytest

from gradient.wire import protocol as p
from tests.fake_server import (
    BUILDER,
    TOKEN,
    FakeServer,
    assign,
    build,
    fleet_of_one,
    hold,
    ready,
    running,
)
from workers.simulator import (
    Fleet,
    SimulatedWorker,
    WorkerConfig,
)


@pytest.mark.asyncio
async def test_error_frames_are_recorded_and_the_session_goes_on():
    async with fleet_of_one() as (worker, session):
        await session.send(p.Error(code="not_allowed", message="not yours"))
        await session.send("not json")
        await session.send(p.JobOffer(jobs=[]))
        assert await session.expect(p.JobScores) == p.JobScores(scores=[])
        assert list(worker.errors) == [{"code": "not_allowed", "message": "not yours"}]
        assert (await worker.wait_event("error", code="unparsable"))["message"]


@pytest.mark.asyncio
async def test_assignment_it_could_never_report_is_refused():
    async with fleet_of_one() as (worker, session):
        await session.send(assign(assignment_id="not-a-uuid"))
        refused = await session.expect(p.AssignJobResponse)
        assert (refused.accepted, refused.reason) == (False, "malformed job or assignment id")
        await session.send(assign(job_id="build:nope"))  # not even an answer could name it
        await session.expect_quiet()
        assert await worker.wait_event("error", code="cannot_answer")
        assert not worker.jobs


@pytest.mark.asyncio
async def test_drain_stops_requests_and_gives_up_held_members():
    config = WorkerConfig(eval=False, max_builds=2, job_secs=(0.2, 0.2))
    async with fleet_of_one(config) as (worker, session):
        await session.send(assign(build(1)))
        await session.send(assign(build(2), cluster=hold()))
        await session.expect(p.AssignJobResponse)
        await session.expect(p.AssignJobResponse)
        await worker.drain()
        await session.expect(p.Draining)
        failed = await session.expect(p.JobFailed)
        assert (failed.job_id, failed.kind) == (build(2), "aborted")
        await session.send(assign(build(3)))
        refused = await session.expect(p.AssignJobResponse)
        assert (refused.accepted, refused.reason) == (False, "draining")
        assert (await session.expect(p.JobCompleted)).job_id == build(1)  # running jobs finish
        await session.expect_quiet()  # and no RequestJob any more


@pytest.mark.asyncio
async def test_forbidden_handshake_stops_for_good():
    config = replace(BUILDER, forbidden_retries=0)
    async with FakeServer(status=403) as server:
        worker = SimulatedWorker("w", TOKEN, config, url=server.url)
        await asyncio.wait_for(worker.run(), 3)
    assert worker.stopped_reason == "forbidden"
    assert server.handshakes == 1


@pytest.mark.asyncio
async def test_a_403_is_tried_again_a_few_times_after_a_long_wait():
    """daphne answers 403 to a handshake not accepted in time too: an overloaded server must
    not lose its workers for good."""
    config = replace(BUILDER, forbidden_retries=2, forbidden_backoff=0.2)
    async with FakeServer(status=403) as server:
        worker = SimulatedWorker("w", TOKEN, config, url=server.url)
        began = time.monotonic()
        await asyncio.wait_for(worker.run(), 5)
    assert worker.stopped_reason == "forbidden"
    assert server.handshakes == 3
    assert time.monotonic() - began > 0.15 + 0.3  # 0.2 then 0.4, each jittered by a quarter


@pytest.mark.asyncio
async def test_other_handshake_refusals_are_retried():
    async with FakeServer(status=503) as server:
        worker = SimulatedWorker("w", TOKEN, BUILDER, url=server.url)
        async with running(worker):
            while server.handshakes < 3:
                await asyncio.sleep(0.02)
        assert worker.stopped_reason == "stopped"


@pytest.mark.asyncio
async def test_replaced_connection_stops_for_good():
    async with FakeServer() as server:
        worker = SimulatedWorker("w", TOKEN, BUILDER, url=server.url)
        task = asyncio.create_task(worker.run())
        session = await server.session()
        await session.handshake()
        await session.ws.close(code=4409, reason="replaced")
        await asyncio.wait_for(task, 3)
    assert worker.stopped_reason == "replaced"
    assert server.handshakes == 1


@pytest.mark.asyncio
async def test_dropped_connection_reconnects_resends_capabilities_and_drops_holds():
    async with FakeServer() as server:
        worker, task, first = await ready(server)
        try:
            await first.send(assign(cluster=hold()))
            await first.expect(p.AssignJobResponse)
            first.ws.transport.abort()  # a server crash: no close frame
            await worker.wait_event("released_hold", reason="disconnected")

            second = await server.session()
            await second.handshake()
            assert await second.expect(p.RequestJob) == p.RequestJob(kind="build")
            await second.expect_quiet()  # the dropped member is not reported
            assert worker.connections == 2
            assert server.authorizations == [f"Bearer {TOKEN}"] * 2
        finally:
            await worker.stop()
            await asyncio.wait_for(task, 5)


@pytest.mark.asyncio
async def test_report_made_while_disconnected_is_sent_after_init_ack():
    config = WorkerConfig(eval=False, job_secs=(0.2, 0.2), backoff=(0.02, 0.05))
    async with FakeServer() as server:
        worker = SimulatedWorker("w", TOKEN, config, url=server.url)
        async with running(worker):
            first = await server.session()
            await first.handshake()
            await first.expect(p.RequestJob)
            await first.send(assign())
            await first.expect(p.AssignJobResponse)
            first.ws.transport.abort()

            second = await server.session()
            await second.expect(p.WorkerCapabilities)
            await worker.wait_event("completed")  # finished while no session was up
            await second.send(p.InitAck(worker="w"))
            done = await second.expect(p.JobCompleted)
            assert done.job_id == build(1)
            assert await second.expect(p.RequestJob) == p.RequestJob(kind="build")


@pytest.mark.asyncio
async def test_with_several_urls_each_reconnect_tries_the_next_server():
    async with FakeServer() as first, FakeServer() as second:
        urls = [first.url, second.url]
        worker = SimulatedWorker("w", TOKEN, BUILDER, url=urls)
        async with running(worker):
            session = await first.session()
            await session.handshake()
            await session.expect(p.RequestJob)
            session.ws.transport.abort()  # the first server dies: no close frame
            first.server.close()

            other = await second.session()  # straight to the other one
            await other.handshake()
            assert await other.expect(p.RequestJob) == p.RequestJob(kind="build")
            assert worker.url == second.url and worker.connections == 2

            other.ws.transport.abort()  # round robin: the dead first, then the second again
            again = await second.session()
            await again.handshake()
            await again.expect(p.RequestJob)
    attempts = ("connected", "connect_failed")
    tried = [(e["event"], e["url"]) for e in worker.events if e["event"] in attempts]
    assert tried == [
        ("connected", first.url),
        ("connected", second.url),
        ("connect_failed", first.url),
        ("connected", second.url),
    ]
    # A fleet spreads its workers over the servers, each starting on its own.
    fleet = Fleet([(f"sim-{i}", "t", BUILDER) for i in range(3)], url=urls)
    assert [w.urls for w in fleet.workers] == [urls, urls[::-1], urls]
