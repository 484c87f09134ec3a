"""The fault suite's own PostgreSQL and Redis: a throwaway cluster and a child redis-server on
free ports, so restarting them never touches the machine's shared services (other people's test
runs use those)."""

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DATABASE = "gradient_faults"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(every)


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def postgres_bin() -> Path:
    """The newest installed server's binaries (Debian's layout), else whatever is on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_version)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    if on_path is None:
        raise RuntimeError("the fault suite needs PostgreSQL's initdb and pg_ctl")
    return Path(on_path).parent


def _version(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in Path(path).parts[-3].split("."))


class PrivatePostgres:
    """initdb + pg_ctl in a temporary directory, trust auth on 127.0.0.1 only. initdb refuses to
    run as root, so as root every pg command runs as the `postgres` user (who owns the
    directory)."""

    def __init__(self):
        self.port = free_port()
        self.bin = postgres_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="gradient-faults-pg-"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def conninfo(self, dbname: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname} connect_timeout=3"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": self.port,
            "unix_socket_directories": f"'{self.dir}'",
            "max_connections": 300,
            # Throwaway data: durability buys nothing here and costs the 2-core CI machine.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
        }
        with open(self.data / "postgresql.auto.conf", "a") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self.pg_ctl("start")
        import psycopg

        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")

    def pg_ctl(self, action: str, *extra: str) -> None:
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.logfile), "-w", *extra)

    def restart(self) -> None:
        """Every connection of every process dies; the server is back when this returns."""
        self.pg_ctl("restart", "-m", "fast")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    """redis-server as a child process, no persistence: a restart loses every key, as a crash
    of a real Redis without persistence would."""

    def __init__(self, logs: Path):
        self.port = free_port()
        self.logs = logs
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.logs / "redis.log", "a")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(lambda: port_open(self.port), 10, "redis-server listening")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        """Killed (no clean shutdown) and started again, empty, on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
