"""The fault suite's own PostgreSQL and Redis (never the machine's shared ones: the suite restarts
them), made and migrated for the fault tests, and the system under test on top of them.

The tests read the database with psycopg directly; pytest-django's test database is not used.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.services import PrivatePostgres, PrivateRedis
from tests.faults.stack import ROOT, Stack

RESULTS: list[dict] = []  # one entry per fault, for the summary at the end of the run


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    # The suite's processes run in sessions of their own, so a pytest stopped by SIGTERM (a
    # CI timeout, `timeout`) would leave them running: stop as on Ctrl-C, through teardown.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    logs = tmp_path_factory.mktemp("faults")
    postgres, redis = PrivatePostgres(), PrivateRedis(logs)
    try:
        postgres.start()
        redis.start()
        env = {**os.environ, "DATABASE_URL": postgres.url, "REDIS_URL": redis.url}
        migrate = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        yield postgres, redis, logs
    finally:
        redis.stop()
        postgres.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def stack(services):
    postgres, redis, logs = services
    stack = Stack(postgres.url, redis.url, postgres.conninfo(), logs)
    stack.define()
    try:
        stack.start_all()
        yield stack
    finally:
        stack.stop_all()
        for name, proc in stack.procs.items():
            assert not proc.alive, f"{name} still running"


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("faults")
    for r in RESULTS:
        terminalreporter.write_line(
            "  ".join(f"{k}={v}" for k, v in r.items() if not isinstance(v, list | dict))
        )


def logs_hint(stack: Stack) -> str:
    return f"(process logs and fleet events in {Path(stack.logs)})"
