"""The fault suite's system under test, all real processes on the suite's own PostgreSQL and
Redis: two daphne instances, two Celery workers, two beats, a fleet of reference workers in a
few processes (each worker knows both daphne URLs) and a load generator. Any of them can be
SIGKILLed and started again; every process's output goes to a log file of its own, appended
across restarts."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from tests.faults.services import free_port, port_open, wait_until

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PROJECT = "faults"

# Short spec durations, so the real code runs in test time.
PREPARE_TIMEOUT_SECS = 3.0
DISPATCH_INTERVAL_SECS = 1.0
# A live session writes last_seen_at every quarter of this (workers.liveness): 2.5 s.
WORKER_TIMEOUT_SECS = 10.0
SETTINGS = {
    "GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS": str(DISPATCH_INTERVAL_SECS),
    "GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS": str(PREPARE_TIMEOUT_SECS),
    "GRADIENT_CLUSTER_RETRY_BACKOFF_SECS": "1",
    "GRADIENT_WORKER_TIMEOUT_SECS": str(WORKER_TIMEOUT_SECS),
    # The hung and flaky workers are quarantined after three blamed seats; back on probation
    # within seconds, they are seated again (and quarantined again at once), so the suite keeps
    # meeting prepares that hang, which it needs to hit, with quarantine and probation at work.
    "GRADIENT_QUARANTINE_SECS": "5",
}

FLEET_PROCESSES = 5
WORKERS_PER_PROCESS = 4
ZONES = "a,b,c"
HUNG_IN = {FLEET_PROCESSES - 1: 2}  # fleet process -> how many of its workers hang
# Fleet process -> the ways its flaky workers fail their cluster members (one worker each):
# the invariants must hold while the server blames and quarantines them.
FLAKY_IN = {0: "reject", 1: "lose"}


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict
    popen: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Stack:
    def __init__(self, database_url: str, redis_url: str, conninfo: str, logs: Path):
        self.conninfo = conninfo
        self.logs = logs
        self.env = {
            **os.environ,
            **SETTINGS,
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "DJANGO_SETTINGS_MODULE": "gradient.settings",
            "PYTHONUNBUFFERED": "1",
        }
        self.daphne_ports = [free_port(), free_port()]
        self.urls = [f"ws://127.0.0.1:{port}/proto" for port in self.daphne_ports]
        self.procs: dict[str, Proc] = {}
        self._db: psycopg.Connection | None = None

    # Processes

    def define(self) -> None:
        python, celery = str(VENV_BIN / "python"), str(VENV_BIN / "celery")
        for i, port in enumerate(self.daphne_ports):
            daphne = [str(VENV_BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port)]
            self._define(f"daphne-{i}", [*daphne, "gradient.asgi:application"])
        for i in range(2):
            worker = [celery, "-A", "gradient", "worker", "-c", "2", "-l", "info"]
            options = ["--without-mingle", "--without-gossip", "-n", f"faults-{i}@%h"]
            self._define(f"celery-{i}", [*worker, *options])
            beat = [celery, "-A", "gradient", "beat", "-l", "info"]
            self._define(f"beat-{i}", [*beat, "-s", str(self.logs / f"beat-{i}-schedule")])
        for i in range(FLEET_PROCESSES):
            fleet = {
                "--prefix": f"f{i}",
                "--count": WORKERS_PER_PROCESS,
                "--zones": ZONES,
                "--zone-offset": i * WORKERS_PER_PROCESS,
                "--url": ",".join(self.urls),
                "--log": self.events_path(i),
                "--hung": HUNG_IN.get(i, 0),
                "--flaky": FLAKY_IN.get(i, ""),
            }
            options = [str(part) for option in fleet.items() for part in option]
            self._define(f"fleet-{i}", [python, "-m", "tests.faults.fleet_proc", *options])
        self._define("load", [python, "-m", "tests.faults.load", "--project", PROJECT])

    def _define(self, name: str, args: list[str]) -> None:
        # PGAPPNAME names each process's connections in pg_stat_activity (a pass's lock holder).
        self.procs[name] = Proc(name, args, {**self.env, "PGAPPNAME": name})

    def events_path(self, i: int) -> Path:
        return self.logs / f"events-fleet-{i}.jsonl"

    def event_files(self) -> list[Path]:
        return [self.events_path(i) for i in range(FLEET_PROCESSES)]

    def start(self, name: str) -> None:
        proc = self.procs[name]
        assert not proc.alive, f"{name} is running"
        log = open(self.logs / f"{name}.log", "a")  # noqa: SIM115 - the child keeps it
        log.write(f"\n==== {datetime.now(UTC).isoformat()} start\n")
        log.flush()
        proc.popen = subprocess.Popen(
            proc.args,
            cwd=ROOT,
            env=proc.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        log.close()

    def start_all(self) -> None:
        """Servers first, then the passes, then the fleet and the load."""
        for i in range(2):
            self.start(f"daphne-{i}")
        for i in range(2):
            self.start(f"celery-{i}")
            self.start(f"beat-{i}")
        for i, port in enumerate(self.daphne_ports):
            wait_until(lambda p=port: port_open(p), 60, f"daphne-{i} listening")
        for i in range(2):
            self.wait_ready(f"celery-{i}")
        for i in range(FLEET_PROCESSES):
            self.start(f"fleet-{i}")
        self.start("load")

    def wait_ready(self, name: str) -> None:
        if name.startswith("daphne-"):
            port = self.daphne_ports[int(name.split("-")[1])]
            wait_until(lambda: port_open(port), 60, f"{name} listening")
        elif name.startswith("celery-"):
            wait_until(lambda: "ready." in self.log_since_start(name), 90, f"{name} ready")

    def log_since_start(self, name: str) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return text.rsplit("==== ", 1)[-1]

    def kill(self, name: str) -> None:
        """SIGKILL to the process and everything it started (a Celery worker's pool)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def restart(self, name: str) -> None:
        if self.procs[name].alive:
            self.kill(name)
        self.start(name)
        self.wait_ready(name)

    def heal(self) -> None:
        """Every process of the topology running again (those a fault killed, started anew)."""
        for name, proc in self.procs.items():
            if not proc.alive:
                self.start(name)
        for name in self.procs:
            self.wait_ready(name)

    def stop(self, name: str, timeout: float = 10) -> None:
        proc = self.procs[name]
        if not proc.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(name)

    def stop_all(self) -> None:
        for name in ["load", *[n for n in self.procs if n != "load"]]:
            self.stop(name)
        self.close_db()

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs.items() if not proc.alive]

    # The database, as the test reads it

    def db(self) -> psycopg.Connection:
        if self._db is None or self._db.closed or self._db.broken:
            self._db = psycopg.connect(self.conninfo, autocommit=True)
        return self._db

    def close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def retry(self, read):
        """`read()`, with a PostgreSQL restart waited out (tries again on a fresh connection)."""
        for attempt in range(60):
            try:
                return read()
            except psycopg.OperationalError:
                self.close_db()
                if attempt == 59:
                    raise
                time.sleep(0.25)
        raise AssertionError("unreachable")

    def query(self, sql: str, params=None) -> list[tuple]:
        return self.retry(lambda: self.db().execute(sql, params).fetchall())

    def now(self) -> datetime:
        return self.query("SELECT clock_timestamp()")[0][0]

    # Where workers are

    def fleet_process_of(self, worker: str) -> str:
        return f"fleet-{worker.split('-')[0].removeprefix('f')}"

    def daphne_of(self, worker: str) -> str | None:
        """The daphne a worker last connected to, from its fleet's event log."""
        url = last_url = None
        path = self.events_path(int(self.fleet_process_of(worker).split("-")[1]))
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("worker") == worker and event.get("event") == "init_ack":
                    url = last_url
                elif event.get("worker") == worker and event.get("event") == "connected":
                    last_url = event.get("url")
        return None if url is None else f"daphne-{self.urls.index(url)}"
