"""Real `gradient-worker` agents for end-to-end tests (tests.agent_harness), each with a worker
row of the test database, a work directory and an endpoint."""

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from clusters.models import ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob
from tests.agent_harness import AgentProcess, agent_env
from tests.e2e.conftest import VENV_BIN, free_port
from tests.e2e.fleet import q, until
from tests.factories import WorkerFactory
from workers.models import Worker, hash_token


class Agent(AgentProcess):
    """The agent of the worker NAME (token t-NAME), with a work directory and an endpoint of its
    own, `gradient-worker signal` on its members' PATH, and a one-second kill grace."""

    def __init__(self, name: str, url: str, tmp: Path, *args: str, zone: str | None = None):
        self.name = name
        self.endpoint = f"127.0.0.1:{free_port()}"
        options = ["--url", url, "--workdir", str(tmp / f"agent-{name}")]
        options += ["--endpoint", self.endpoint, "--kill-grace", "1"]
        options += ["--zone", zone] if zone else []
        path = f"{VENV_BIN}:{os.environ.get('PATH', '')}"
        super().__init__(*options, *args, env=agent_env(token=f"t-{name}", PATH=path))

    async def stop(self) -> None:
        """As an operator would: SIGINT ends what runs and reports it; then nothing is left."""
        if self.proc.returncode is None:
            self.signal(signal.SIGINT)
            with contextlib.suppress(TimeoutError):
                await self.exit_status(timeout=15)
        await self.__aexit__(None, None, None)


async def make_workers(*names: str, projects=None) -> None:
    def create():
        for name in names:
            worker = WorkerFactory(
                name=name, token_hash=hash_token(f"t-{name}"), all_projects=projects is None
            )
            if projects is not None:
                worker.projects.set(projects)

    await q(create)


@contextlib.asynccontextmanager
async def agents(url: str, tmp: Path, specs: dict[str, dict]):
    """Runs one agent per name (specs: `zone`, `args`), until every one is connected."""
    await make_workers(*specs)
    running = {}
    try:
        for name, spec in specs.items():
            agent = Agent(name, url, tmp, *spec.get("args", ()), zone=spec.get("zone"))
            running[name] = await agent.__aenter__()
        await connected(*specs)
        yield running
    finally:
        for agent in running.values():
            await agent.stop()


async def connected(*names: str, timeout: float = 30.0) -> None:
    await until(
        lambda: (
            Worker.objects.filter(name__in=names, channel_name__isnull=False).count() == len(names)
        ),
        timeout=timeout,
    )


def finished(cluster_id: int) -> str | None:
    status = ClusterJob.objects.values_list("status", flat=True).get(pk=cluster_id)
    return status if status not in (ClusterStatus.QUEUED, ClusterStatus.RUNNING) else None


def seats(cluster_id: int) -> list[DispatchedJob]:
    return list(
        DispatchedJob.objects.filter(cluster_attempt__cluster_job_id=cluster_id)
        .select_related("worker")
        .order_by("dispatched_at")
    )


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie of an exited child counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def gone(pids, timeout: float) -> float:
    """Seconds until none of `pids` runs; fails past `timeout`."""
    start = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - start > timeout:
            left = [pid for pid in pids if alive(pid)]
            raise AssertionError(f"processes {left} still running after {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def pids_in(directory: Path, count: int, timeout: float = 30.0) -> list[int]:
    """The pids that `count` member processes wrote as `*.pid` files into `directory`."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(directory.glob("*.pid"))
        if len(files) >= count and all(f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(files)} of {count} member processes started")
        await asyncio.sleep(0.05)
