"""The reference worker (workers.simulator) against a fake server on a real socket: its
scores, its session, its fleet and log, and the command's arguments. The server side is written
elsewhere, so these tests play it themselves, frame by frame (tests/fake_server.py)."""

import asyncio
import json
from dataclasses import replace

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gradient.wire import protocol as p
from tests.fake_server import (
    ASSIGNMENT,
    BUILDER,
    TOKEN,
    FakeServer,
    assign,
    build,
    fleet_of_one,
    hold,
    running,
)
from workers.simulator import (
    Fleet,
    SimulatedWorker,
    WorkerConfig,
    missing_cost,
    path_nar_size,
)

# Scoring


def test_scores_are_stable_and_follow_have_fraction():
    paths = [f"/nix/store/{i}-p" for i in range(50)]
    assert missing_cost("w", paths, 1.0) == (0, 0)
    assert missing_cost("w", paths, 0.0) == (50, sum(map(path_nar_size, paths)))
    half = missing_cost("w", paths, 0.5)
    assert half == missing_cost("w", paths, 0.5)
    assert 0 < half[0] < 50
    assert half != missing_cost("other", paths, 0.5)  # each worker has its own share


# Session


@pytest.mark.asyncio
async def test_capabilities_first_then_requests_and_scores_before_next_request():
    config = WorkerConfig(
        architectures=("x86_64-linux", "aarch64-linux"),
        system_features=("kvm",),
        max_evals=1,
        max_builds=2,
        zone="z1",
        endpoint="sim://w",
        job_secs=(0.05, 0.05),
        have_fraction=0.0,
    )
    async with FakeServer() as server:
        worker = SimulatedWorker("w", TOKEN, config, url=server.url)
        async with running(worker):
            session = await server.session()
            capabilities = await session.handshake()
            assert capabilities == worker.capabilities()
            assert capabilities.zone == "z1" and capabilities.max_concurrent_builds == 2
            kinds = [(await session.expect(p.RequestJob)).kind for _ in range(3)]
            assert kinds == ["eval", "build", "build"]

            jobs = [
                p.OfferedJob(
                    job_id=build(i),
                    kind="build",
                    project="p",
                    architecture="x86_64-linux",
                    required_features=[],
                    paths=[f"/nix/store/{i}-a", f"/nix/store/{i}-b"],
                )
                for i in range(2)
            ]
            await session.send(p.JobOffer(jobs=jobs))
            await session.send(assign(build(0)))
            scores = await session.expect(p.JobScores)
            assert [s.job_id for s in scores.scores] == [build(0), build(1)]
            assert scores.scores[0].missing_count == 2
            assert scores.scores[0].missing_nar_size == sum(map(path_nar_size, jobs[0].paths))
            response = await session.expect(p.AssignJobResponse)
            assert response == p.AssignJobResponse(job_id=build(0), accepted=True)
            done = await session.expect(p.JobCompleted)
            assert (done.job_id, done.assignment_id) == (build(0), ASSIGNMENT)
            assert done.elapsed_ms >= 40
            assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")
    assert server.authorizations == [f"Bearer {TOKEN}"]


@pytest.mark.asyncio
async def test_failures_follow_fail_rate():
    async with fleet_of_one(WorkerConfig(eval=False, job_secs=(0, 0), fail_rate=1.0)) as (
        worker,
        session,
    ):
        await session.send(assign())
        await session.expect(p.AssignJobResponse)
        failed = await session.expect(p.JobFailed)
        assert (failed.kind, failed.assignment_id) == ("transient", ASSIGNMENT)
        assert worker.failed == 1


@pytest.mark.asyncio
async def test_heartbeat_requests_only_free_slots():
    config = WorkerConfig(heartbeat_secs=0.1)  # one eval and one build slot
    async with fleet_of_one(config) as (_, session):
        await session.send(assign(cluster=hold()))
        await session.expect(p.AssignJobResponse)
        beats = [await session.expect(p.RequestJob) for _ in range(3)]
        assert {b.kind for b in beats} == {"eval"}  # the held member fills the build slot


# Fleet and log


@pytest.mark.asyncio
async def test_fleet_counts_and_logs(tmp_path):
    log = tmp_path / "fleet.jsonl"
    async with FakeServer(auto_ack=True) as server:
        fleet = Fleet(
            [(f"sim-{i}", f"t{i}", BUILDER) for i in range(3)], url=server.url, log_path=str(log)
        )
        run = asyncio.create_task(fleet.run())
        while fleet.counters()["connected"] < 3:
            await asyncio.sleep(0.02)
        counters = fleet.counters()
        assert (counters["idle"], counters["held"], counters["running"]) == (3, 0, 0)
        fleet.stop()
        await asyncio.wait_for(run, 5)
    assert fleet.counters()["connected"] == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {line["worker"] for line in lines} == {"sim-0", "sim-1", "sim-2"}
    assert {"connected", "init_ack", "disconnected", "stopped"} <= {e["event"] for e in lines}
    assert all("time" in line for line in lines)


@pytest.mark.asyncio
async def test_fleet_run_ends_when_every_worker_stopped_for_good():
    async with FakeServer(status=403) as server:
        fleet = Fleet([("sim-0", "t", replace(BUILDER, forbidden_retries=0))], url=server.url)
        await asyncio.wait_for(fleet.run(), 3)
    assert fleet.counters()["stopped"] == 1


# Command arguments: refused before anything is written (so no database is needed)


@pytest.mark.parametrize(
    "args",
    [
        ["--count", "0"],
        ["--count", "2", "--job-secs", "2-1"],
        ["--count", "2", "--job-secs", "fast"],
        ["--count", "2", "--fail-rate", "1.5"],
        ["--count", "2", "--no-eval", "--no-build"],
        ["--count", "2", "--zones", "a,,b"],
        ["--count", "2", "--url", "http://127.0.0.1:8000/proto"],
        ["--count", "2", "--url", "ws://127.0.0.1:8000/proto,http://127.0.0.1:8001/proto"],
        ["--count", "2", "--duration", "0"],
        ["--count", "2", "--max-builds", "-1"],
        ["--count", "100001"],
        ["--count", "2", "--max-builds", str(2**31)],
        ["--count", "2", "--max-evals", str(2**31)],
        ["--count", "2", "--prefix", "sim\x00"],
    ],
)
def test_bad_arguments_are_refused(args):
    with pytest.raises(CommandError):
        call_command("simulate_workers", *args)
