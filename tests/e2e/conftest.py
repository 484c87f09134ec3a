"""Real processes for end-to-end tests: daphne (and Celery) on Redis, against the test
database that pytest-django created, driven over real sockets."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from gradient.redis_db import redis_url

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Keeps test traffic apart from a development server's; two suites run at once need two.
E2E_REDIS_DB = int(os.environ.get("GRADIENT_E2E_REDIS_DB", "7"))
# The spec's durations, shortened so the real code runs in test time instead of patched clocks.
FAST = {
    "GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS": "1",
    "GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS": "3",
    "GRADIENT_CLUSTER_RETRY_BACKOFF_SECS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


def wait_for_log(path: Path, text: str, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} never said {text!r}")


@pytest.fixture(scope="session")
def process_env(django_db_setup):
    """The environment a real process needs to share the test database and a Redis database
    of its own."""
    s = connection.settings_dict
    url = f"postgres://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    env = {
        **os.environ,
        **FAST,
        "DATABASE_URL": url,
        "REDIS_URL": redis_url(E2E_REDIS_DB),
        "DJANGO_SETTINGS_MODULE": "gradient.settings",
        "PYTHONUNBUFFERED": "1",
    }
    subprocess.run(["redis-cli", "-n", str(E2E_REDIS_DB), "flushdb"], capture_output=True)
    return env


# The two ways protocol.md serves /proto: plain daphne, and the README's launcher (one daphne,
# so a test's sessions share a process as they do under plain daphne).
LAUNCHERS = {
    "daphne": lambda port: (
        str(VENV_BIN / "daphne"),
        *("-b", "127.0.0.1", "-p", str(port), "gradient.asgi:application"),
    ),
    "serve": lambda port: (
        sys.executable,
        *("-m", "gradient.serve", "-b", "127.0.0.1", "-p", str(port), "--processes", "1"),
    ),
}


class Processes:
    def __init__(self, env, logs: Path):
        self.env, self.logs, self.procs = env, logs, []

    def start(self, name: str, *args, **extra_env) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**self.env, **{k: str(v) for k, v in extra_env.items()}},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((proc, log))
        return proc

    def daphne(self, launcher="daphne", **extra_env) -> str:
        """The URL of /proto on a new server, started as LAUNCHERS[launcher] starts it."""
        port = free_port()
        proc = self.start(f"daphne-{port}", *LAUNCHERS[launcher](port), **extra_env)
        wait_for_port(port, proc)
        return f"ws://127.0.0.1:{port}/proto"

    def celery(self, **extra_env) -> None:
        """A Celery worker and beat: the passes, on their schedule and on wake-ups."""
        celery = str(VENV_BIN / "celery")
        self.start(
            "celery-worker",
            celery,
            "-A",
            "gradient",
            "worker",
            "-c",
            "2",
            "-l",
            "info",
            "--without-mingle",
            "--without-gossip",
            "-n",
            f"e2e-{free_port()}@%h",
            **extra_env,
        )
        wait_for_log(self.logs / "celery-worker.log", "ready.")
        self.start(
            "celery-beat",
            celery,
            "-A",
            "gradient",
            "beat",
            "-l",
            "info",
            "-s",
            str(self.logs / "beat-schedule"),
            **extra_env,
        )

    def stop(self):
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()

    def log_text(self, name_prefix: str) -> str:
        return "".join(p.read_text() for p in sorted(self.logs.glob(f"{name_prefix}*.log")))


@pytest.fixture
def processes(process_env, transactional_db, tmp_path):
    """Processes of this test alone (to kill or restart them)."""
    procs = Processes(process_env, tmp_path)
    yield procs
    procs.stop()


@pytest.fixture(scope="package")
def _shared_stack(process_env, tmp_path_factory):
    """Package-scoped: its beat must not keep running passes over the test database once the
    tests outside this package, which run passes themselves, begin."""
    procs = Processes(process_env, tmp_path_factory.mktemp("stack"))
    url = procs.daphne()
    procs.celery()
    yield url, procs
    procs.stop()


@pytest.fixture
def stack(_shared_stack, transactional_db) -> str:
    """The URL of /proto on a daphne, with a Celery worker and beat, shared by the session's
    tests (each test's rows are removed after it, as with any transactional test)."""
    return _shared_stack[0]


@pytest.fixture(scope="session", autouse=True)
def _flush_retries_deadlocks():
    """Between tests the shared stack's passes keep running, and the TRUNCATE that empties
    the database can deadlock with one of them; PostgreSQL then aborts one side. Try again."""
    from django.core.management.commands import flush

    original = flush.Command.handle

    def handle(self, *args, **options):
        for attempt in range(5):
            try:
                return original(self, *args, **options)
            except Exception as exc:
                if attempt == 4 or "deadlock" not in str(exc.__cause__ or exc):
                    raise
                time.sleep(0.2)

    flush.Command.handle = handle
    yield
    flush.Command.handle = original
