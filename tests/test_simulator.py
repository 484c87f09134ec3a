"""The reference worker (workers.simulator) against a fake server on a real socket: the server
side is written elsewhere, so these tests play it themselves, frame by frame."""

import asyncio
import contextlib
import json
import time
from dataclasses import replace

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from gradient.wire import protocol as p
from workers.simulator import (
    HOLD_TIMED_OUT,
    Fleet,
    SimulatedWorker,
    WorkerConfig,
    missing_cost,
    path_nar_size,
)

TOKEN = "secret-token"


def uuid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def build(n: int = 1) -> str:
    return f"build:{uuid(n)}"


ATT1, ATT2 = uuid(101), uuid(102)
JOB = build(1)
ASSIGNMENT = uuid(201)
# Build-only, one slot, short jobs and reconnects: one RequestJob per free slot is easy to follow.
BUILDER = WorkerConfig(eval=False, job_secs=(0.05, 0.05), backoff=(0.02, 0.05), seed=1)
SLOW = (5.0, 5.0)  # a job still running when the test acts on it


class Session:
    """One accepted connection, seen from the fake server."""

    def __init__(self, ws):
        self.ws = ws
        self.inbox: asyncio.Queue[p.Message] = asyncio.Queue()

    async def recv(self, timeout: float = 3.0) -> p.Message:
        return await asyncio.wait_for(self.inbox.get(), timeout)

    async def expect(self, kind: type[p.Message], timeout: float = 3.0) -> p.Message:
        message = await self.recv(timeout)
        assert isinstance(message, kind), message
        return message

    async def expect_quiet(self, secs: float = 0.3) -> None:
        with pytest.raises(TimeoutError):
            message = await self.recv(secs)
            pytest.fail(f"unexpected {message!r}")

    async def send(self, message: p.Message | dict | str) -> None:
        if isinstance(message, p.Message):
            message = message.frame()
        elif isinstance(message, dict):
            message = json.dumps(message)
        await self.ws.send(message)

    async def handshake(self, name: str = "w") -> p.WorkerCapabilities:
        capabilities = await self.expect(p.WorkerCapabilities)
        await self.send(p.InitAck(worker=name))
        return capabilities


class FakeServer:
    """Accepts connections on 127.0.0.1 (an ephemeral port), or refuses the handshake with
    `status`; hands each session to the test, with the worker's frames parsed."""

    def __init__(self, status: int | None = None, auto_ack: bool = False):
        self.status = status
        self.auto_ack = auto_ack
        self.handshakes = 0
        self.authorizations: list[str | None] = []
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()

    async def __aenter__(self):
        self.server = await serve(self._handler, "127.0.0.1", 0, process_request=self._check)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/proto"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    def _check(self, connection, request):
        self.handshakes += 1
        self.authorizations.append(request.headers.get("Authorization"))
        if self.status is not None:
            return connection.respond(self.status, "refused\n")
        return None

    async def _handler(self, ws):
        session = Session(ws)
        self.sessions.put_nowait(session)
        with contextlib.suppress(ConnectionClosed):
            async for text in ws:
                message = p.parse_inbound(text)
                if self.auto_ack and isinstance(message, p.WorkerCapabilities):
                    await session.send(p.InitAck(worker="w"))
                session.inbox.put_nowait(message)

    async def session(self, timeout: float = 3.0) -> Session:
        return await asyncio.wait_for(self.sessions.get(), timeout)


@contextlib.asynccontextmanager
async def running(worker: SimulatedWorker):
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        await worker.stop()
        await asyncio.wait_for(task, 5)


def assign(job_id=JOB, kind="build", cluster=None, assignment_id=ASSIGNMENT) -> p.AssignJob:
    spec = p.JobSpec(
        kind=kind,
        project="p",
        evaluation=None,
        build=uuid(301),
        architecture="x86_64-linux",
        required_features=[],
        steps=["build"],
    )
    return p.AssignJob(job_id=job_id, assignment_id=assignment_id, job=spec, cluster=cluster)


def hold(attempt=ATT1, role="r", index=0, hold_secs=5) -> p.ClusterHold:
    return p.ClusterHold(attempt=attempt, role=role, index=index, hold_secs=hold_secs)


def roster(attempt=ATT1) -> p.StartCluster:
    entry = p.RosterEntry(role="r", index=0, worker="w", zone=None, endpoint=None)
    return p.StartCluster(attempt=attempt, roster=[entry])


async def ready(server: FakeServer, worker_config: WorkerConfig = BUILDER):
    """Starts a worker, answers its handshake and takes its first RequestJob(s)."""
    worker = SimulatedWorker("w", TOKEN, worker_config, url=server.url)
    task = asyncio.create_task(worker.run())
    session = await server.session()
    await session.handshake()
    for kind in ("eval", "build"):
        for _ in range(worker.config.slots(kind)):
            assert await session.expect(p.RequestJob) == p.RequestJob(kind=kind)
    return worker, task, session


@contextlib.asynccontextmanager
async def fleet_of_one(config: WorkerConfig = BUILDER, **server_options):
    async with FakeServer(**server_options) as server:
        worker, task, session = await ready(server, config)
        try:
            yield worker, session
        finally:
            await worker.stop()
            await asyncio.wait_for(task, 5)


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


# Cluster members


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


# Robustness


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
    tried = [(e["event"], e["url"]) for e in worker.events if "url" in e]
    assert tried == [
        ("connected", first.url),
        ("connected", second.url),
        ("connect_failed", first.url),
        ("connected", second.url),
    ]
    # A fleet spreads its workers over the servers, each starting on its own.
    fleet = Fleet([(f"sim-{i}", "t", BUILDER) for i in range(3)], url=urls)
    assert [w.urls for w in fleet.workers] == [urls, urls[::-1], urls]


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
