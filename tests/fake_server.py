"""The server side of /proto, played frame by frame on a real socket for the reference
worker (workers.simulator), and the frames the tests send it."""

import asyncio
import contextlib
import json

import pytest
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from gradient.wire import protocol as p
from workers.simulator import (
    SimulatedWorker,
    WorkerConfig,
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

    def __init__(self, status: int | None = None, auto_ack: bool = False, tls=None):
        self.status = status
        self.auto_ack = auto_ack
        self.tls = tls  # an ssl.SSLContext: serve wss://
        self.handshakes = 0
        self.authorizations: list[str | None] = []
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()

    async def __aenter__(self):
        self.server = await serve(
            self._handler, "127.0.0.1", 0, process_request=self._check, ssl=self.tls
        )
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'wss' if self.tls else 'ws'}://127.0.0.1:{port}/proto"
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
