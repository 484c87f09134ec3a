"""The real gradient-worker against a real daphne: a worker created with its token, one job
submitted with a command, run on the agent's machine and completed."""

import asyncio
import signal

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob, Project
from gradient.jobs.submission import JobSpec, create_jobs
from tests.agent_harness import AgentProcess, agent_env
from tests.factories import WorkerFactory
from workers.models import hash_token

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


def q(fn):
    def run():
        try:
            return fn()
        finally:
            connection.close()  # no connection left behind to block the test database's drop

    return sync_to_async(run)()


def submit(command: list[str]) -> DerivationBuild:
    project = Project.objects.create(name="smoke")
    (build,) = create_jobs(project, [JobSpec(kind="build", command=command)])
    return build


async def test_a_job_with_a_command_runs_on_the_agent_and_completes(processes, tmp_path):
    url = processes.daphne()
    await q(lambda: WorkerFactory(name="smoke-agent", token_hash=hash_token("t-smoke")))
    build = await q(lambda: submit(["sh", "-c", 'echo "ran on $GRADIENT_WORKER"']))
    args = ("--url", url, "--workdir", str(tmp_path / "work"), "--store", str(tmp_path))
    async with AgentProcess(*args, env=agent_env(token="t-smoke")) as agent:
        await agent.wait_event("init_ack", worker="smoke-agent", timeout=20)
        started = await agent.wait_event("started", job_id=f"build:{build.pk}", timeout=20)
        assert started["pid"] > 0
        await agent.wait_event("completed", job_id=f"build:{build.pk}", timeout=20)

        async with asyncio.timeout(20):
            while await q(lambda: DerivationBuild.objects.get().status) != BuildStatus.COMPLETED:
                await asyncio.sleep(0.1)
        seat = await q(lambda: DispatchedJob.objects.get())
        assert (str(seat.pk), seat.outcome) == (started["assignment_id"], "Completed")
        assert seat.log_tail == "ran on smoke-agent\n"  # the report's end of the output

        agent.signal(signal.SIGTERM)
        assert await agent.exit_status() == 0
    assert agent.lines == []  # every line on stderr was a JSON event
