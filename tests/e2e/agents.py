"""Real `gradient-worker` agents for end-to-end tests: each one a process of its own, with its
JSON log lines in a file, a worker row of the test database and a work directory."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from clusters.models import ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob
from tests.e2e.conftest import ROOT, VENV_BIN, free_port
from tests.e2e.fleet import q, until
from tests.factories import WorkerFactory
from workers.models import Worker, hash_token

AGENT = str(VENV_BIN / "gradient-worker")
# The keys a worker process must not inherit from the test run: the agent needs none of them.
SERVER_ONLY = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")


class Agent:
    """One gradient-worker process for the worker NAME, logging JSON lines to its own file."""

    def __init__(self, name: str, url: str, tmp: Path, *args: str, zone: str | None = None):
        self.name, self.url = name, url
        self.workdir = tmp / f"agent-{name}"
        self.log_path = tmp / f"agent-{name}.log"
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.args = [
            *("--url", url, "--workdir", str(self.workdir), "--endpoint", self.endpoint),
            *("--kill-grace", "1", "--log-format", "json"),
            *(("--zone", zone) if zone else ()),
            *args,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Agent":
        env = {k: v for k, v in os.environ.items() if k not in SERVER_ONLY}
        env["GRADIENT_WORKER_TOKEN"] = f"t-{self.name}"
        # The members call `gradient-worker signal ...` as an operator's PATH would find it.
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
        log = open(self.log_path, "a")  # noqa: SIM115 - closed when the process is
        self.proc = subprocess.Popen(
            [AGENT, *self.args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        return self

    def events(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    async def wait_exit(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"agent {self.name} still running after {timeout}s")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # abort what runs, report it, exit
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
    running = {
        name: Agent(name, url, tmp, *spec.get("args", ()), zone=spec.get("zone")).start()
        for name, spec in specs.items()
    }
    try:
        await connected(*specs)
        yield running
    finally:
        for agent in running.values():
            agent.stop()


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
