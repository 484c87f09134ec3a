"""A real gradient-worker against the fake server of tests/fake_server.py: the frames a test
sends it and the session it opens."""

import contextlib

from gradient.wire import protocol as p
from tests.agent_harness import AgentProcess
from tests.fake_server import FakeServer, Session, assign, build, uuid

WORKER = "agent-1"


def job(
    command: list[str] | None,
    n: int = 1,
    cluster: p.ClusterHold | None = None,
    env: dict[str, str] | None = None,
    timeout_secs: int | None = None,
) -> p.AssignJob:
    """An AssignJob for build:n (assignment n + 200) that runs `command`."""
    frame = assign(build(n), cluster=cluster, assignment_id=uuid(200 + n))
    what = {"command": command, "env": env or {}, "timeout_secs": timeout_secs}
    return frame.model_copy(update={"job": frame.job.model_copy(update=what)})


async def handshake(session: Session, builds: int = 1) -> p.WorkerCapabilities:
    """InitAck with a long heartbeat (no RequestJob repeats within a test), and the first
    RequestJob of each build slot."""
    capabilities = await session.expect(p.WorkerCapabilities)
    await session.send(p.InitAck(worker=WORKER, heartbeat_secs=600))
    for _ in range(builds):
        await session.expect(p.RequestJob)
    return capabilities


@contextlib.asynccontextmanager
async def connected(tmp_path, *args: str, builds: int = 1, **server_options):
    """A fake server and an agent connected to it, past its handshake."""
    async with FakeServer(**server_options) as server:
        workdir = str(tmp_path / "work")
        extra = ["--builds", str(builds), *args]
        async with AgentProcess("--url", server.url, "--workdir", workdir, *extra) as agent:
            session = await server.session()
            await handshake(session, builds)
            yield agent, session, server
