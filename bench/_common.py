"""What the benchmark scripts share: the bench database, real processes (daphne, Celery),
docs/benchmarks.md sections, percentiles.

Import order matters: a script calls `setup(database_url)` before importing anything of the
project, since Django reads DATABASE_URL once, at set-up.
"""

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench"
DOC = ROOT / "docs" / "benchmarks.md"


def setup(database_url: str, redis_db: int) -> None:
    """Point Django at the bench database (never at an ambient DATABASE_URL) and at a Redis
    database of the benchmark's own (metrics, wake-ups), and set it up."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from gradient.redis_db import redis_url  # reads no setting: Django is not set up yet

    os.environ["DATABASE_URL"] = database_url
    os.environ["REDIS_URL"] = redis_url(redis_db)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    import django

    django.setup()


def ensure_database() -> None:
    """Create the bench database when missing and migrate it; a database whose migrations no
    longer apply (they changed since it was made) is dropped and made afresh. Then empty it."""
    import psycopg
    from django.core.management import call_command
    from django.db import connection
    from psycopg import sql

    name = connection.settings_dict["NAME"]

    def admin(statement):
        with psycopg.connect(os.environ["DATABASE_URL"], dbname="postgres", autocommit=True) as c:
            exists = c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            if statement == "create" and not exists:
                c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            elif statement == "drop" and exists:
                c.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    admin("create")
    try:
        call_command("migrate", verbosity=0)
    except Exception as exc:
        print(f"migrate failed ({exc!r}); recreating {name}", flush=True)
        connection.close()
        admin("drop")
        admin("create")
        call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(project_tables())} RESTART IDENTITY CASCADE")


def project_tables() -> list[str]:
    """Every table of the project's own apps (models and many-to-many tables)."""
    from django.apps import apps

    tables = set()
    for label in ("jobs", "workers", "clusters"):
        for model in apps.get_app_config(label).get_models(include_auto_created=True):
            tables.add(model._meta.db_table)
    return sorted(tables)


def cpu_secs(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of a process and its live descendants (Celery's pool)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{pid}/task").iterdir() if children else ():
            for child in (task / "children").read_text().split():
                total += cpu_secs(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def database_backends(exclude: Iterable[int] = ()) -> list[int]:
    """The PostgreSQL backends serving the bench database (autovacuum's among them), but the
    one asking and those in `exclude` (the bench's own connections)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND NOT pid = ANY(%s)",
            [list(exclude)],
        )
        return [row[0] for row in cursor.fetchall()]


class CpuMeter:
    """CPU seconds spent by each part of the stack between start() and stop(), from /proc:
    each named group of processes (with their descendants), this process alone under
    `this_process` (daphne and Celery are its children), and the PostgreSQL backends serving
    the bench database as "postgres". A backend that closed before stop() counts up to the
    last observe() that saw it. The three query the database (the asking backend is left out)."""

    def __init__(
        self,
        groups: dict[str, list[int]],
        this_process: str | None = None,
        exclude_backends: Iterable[int] = (),
    ):
        self.groups, self.this_process = groups, this_process
        self.exclude = set(exclude_backends)
        self.first: dict[int, float] = {}  # backend pid -> CPU s when first seen
        self.last: dict[int, float] = {}  # ... and when last seen
        self.starting = False

    def _processes(self) -> dict[str, float]:
        out = {name: sum(map(cpu_secs, pids)) for name, pids in self.groups.items()}
        if self.this_process is not None:
            out[self.this_process] = cpu_secs(os.getpid(), children=False)
        return out

    def observe(self) -> None:
        for pid in set(database_backends(self.exclude)) | set(self.last):
            secs = cpu_secs(pid)  # 0 once it exited: the last reading stays
            # One that connected after start() spent all its CPU since.
            self.first.setdefault(pid, secs if self.starting else 0.0)
            self.last[pid] = max(self.last.get(pid, 0.0), secs)

    def start(self) -> None:
        self.first.clear()
        self.last.clear()
        self.starting = True
        self.observe()
        self.starting = False
        self.began = self._processes()

    def stop(self) -> dict[str, float]:
        self.observe()
        now = self._processes()
        spent = {name: now[name] - self.began[name] for name in now}
        spent["postgres"] = sum(self.last[pid] - self.first[pid] for pid in self.last)
        return spent


def analyze() -> None:
    """Statistics, as autovacuum keeps them on a database in use: one emptied moments ago
    has row estimates of 1, and PostgreSQL plans the hot statements as for empty tables."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {', '.join(project_tables())}")


class Feeder:
    """Keeps a queue topped up from a thread: top_up() every `tick` seconds until `stop` is
    set. An exception ends it and is kept in `error`, for the caller to raise."""

    def __init__(self, tick: float = 0.25):
        self.tick = tick
        self.stop = threading.Event()
        self.measuring = False  # set by the caller over the window
        self.error: BaseException | None = None

    def top_up(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        from django.db import connection

        try:
            while not self.stop.is_set():
                began = time.monotonic()
                self.top_up()
                self.stop.wait(max(0.0, self.tick - (time.monotonic() - began)))
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()


def process_env(**extra) -> dict:
    """The environment of a daphne or Celery process: the bench database and Redis database
    that setup() chose."""
    return {
        **os.environ,
        "DATABASE_URL": os.environ["DATABASE_URL"],
        "REDIS_URL": os.environ["REDIS_URL"],
        "DJANGO_SETTINGS_MODULE": "gradient.settings",
        "PYTHONUNBUFFERED": "1",
        **{k: str(v) for k, v in extra.items()},
    }


def flush_redis(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {port}")


def wait_for_log(path: Path, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} never said {text!r}")


class Processes:
    """daphne and Celery as subprocesses of the script (each in its own session, so a kill
    reaches its children), with their logs in one directory. stop() ends every one."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs = env, logs
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.names: dict[int, str] = {}  # pid -> the name given to start()
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Start `args` as NAME, in the processes' environment unless `env` is given."""
        log = open(self.logs / f"{name}.log", "a")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=self.env if env is None else env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((proc, log))
        self.names[proc.pid] = name
        return proc

    def pids(self, *names: str) -> list[int]:
        """The processes started under these names (a meter's group)."""
        return [proc.pid for proc, _ in self.procs if self.names[proc.pid] in names]

    @staticmethod
    def daphne_args(port: int) -> tuple[str, ...]:
        # The README's command: daphne processes, one per core, on one socket with a listen
        # backlog for a fleet that reconnects all at once (gradient.serve).
        return (
            str(VENV_BIN / "python"),
            "-m",
            "gradient.serve",
            "-b",
            "127.0.0.1",
            "-p",
            str(port),
        )

    def daphne(self, port: int) -> subprocess.Popen:
        proc = self.start("daphne", *self.daphne_args(port))
        wait_for_port(port, proc)
        return proc

    def celery(self) -> None:
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
            f"bench-{os.getpid()}@%h",
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
        )

    @staticmethod
    def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(10)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, log in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def crashes(log: str) -> list[str]:
    """Lines of a log that show an exception escaping a consumer (daphne) or a task (Celery)."""
    return [
        line
        for line in log.splitlines()
        if "Exception inside application" in line or "raised unexpected" in line
    ]


def tracebacks(log: str) -> int:
    """Tracebacks of any kind, crashes or warnings logged with their exception."""
    return sum(line.startswith("Traceback") for line in log.splitlines())


def log_problems(procs: Processes) -> tuple[list[str], int]:
    """daphne's and the Celery worker's crash lines, and their tracebacks of any kind."""
    logs = [procs.log_text("daphne"), procs.log_text("celery-worker")]
    return [line for log in logs for line in crashes(log)], sum(map(tracebacks, logs))


def median_text(values: list[float], digits: int = 1) -> str:
    """A figure's median over a benchmark's runs, with the runs' range when there are several:
    one run moves enough from the next that a target is judged on the median."""
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    low, high = min(values), max(values)
    return f"{mid:.{digits}f} (median of {len(values)}: {low:.{digits}f} to {high:.{digits}f})"


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0..100), linear between the closest ranks."""
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(p) - 1]


def now_line() -> str:
    return f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"


def settle(below: float, most_secs: float = 300.0) -> None:
    """Before a run that is compared with another: a CHECKPOINT, so that the last run's dirty
    pages are not written during this one, then a wait (at most `most_secs`) until the 1-minute
    load average is below `below` (0: no wait). Started at once, a run measures the tail of
    the one before it, and the later sizes of one command would all start loaded."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")
    connection.close()
    deadline = time.monotonic() + most_secs
    while below and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def load() -> str:
    """The 1-minute load average: the machine is shared, and figures move with it."""
    return f"{os.getloadavg()[0]:.1f}"


def machine() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        pg = cursor.fetchone()[0]
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{cores} cores ({cpu_speed()}), PostgreSQL {pg.split()[0]}"


def cpu_speed() -> str:
    """How fast this machine runs Python right now: on this shared host the same planner run
    took 0.19 s at one hour and 0.51 s at another, and every figure moves with it. The best
    of three runs of a fixed loop, so sections taken at different hours can be compared."""
    best = min(_timed_loop() for _ in range(3))
    return f"reference loop {best:.2f} s"


def _timed_loop() -> float:
    began = time.perf_counter()
    sum(range(10_000_000))
    return time.perf_counter() - began


WIDTH = 100  # the generated prose is wrapped here, so no line needs scrolling sideways


def parse_grid(text: str) -> list[tuple[int, int]]:
    """Sizes as the scripts take them: "100x500,1000x5000" -> [(100, 500), (1000, 5000)]."""
    return [tuple(int(n) for n in point.split("x")) for point in text.split(",")]


def paragraph(text: str) -> str:
    """One paragraph of prose, wrapped at WIDTH."""
    return textwrap.fill(text, WIDTH, break_on_hyphens=False, break_long_words=False)


def bullets(items: Iterable[str]) -> str:
    """A markdown list, each item wrapped at WIDTH under its own indent."""
    return "\n".join(
        textwrap.fill(
            item,
            WIDTH,
            initial_indent="- ",
            subsequent_indent="  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        for item in items
    )


def run_facts(command: str, load: str) -> list[str]:
    """The bullets every section ends its text with: how to reproduce it and under what load."""
    return [
        f"Command: `{command}`",
        f"Date: {now_line()}",
        f"Machine: {machine()} on the same host over TCP, shared with other work"
        f" (load average {load})",
    ]


def section_text(title: str, lead: str, method: list[str], facts: list[str], body: str) -> str:
    """A section: its title, one sentence of what it measures, the method's bullets, the run's
    facts (a list of their own), then its table."""
    parts = [title, paragraph(lead), bullets(method), "The run:", bullets(facts), body]
    return "\n\n".join(parts) + "\n"


# The summary table: one row per figure with a target, at the top of the file. A benchmark's
# rows carry its `bench/run NAME` as their command, which is how a run finds its own rows.
SUMMARY = "## Summary"
SUMMARY_HEADER = ["figure", "target", "result", "met", "command"]
SUMMARY_LEAD = (
    "Every figure that has a target. Each benchmark rewrites its own rows when it writes its"
    " section (the figure links to it); a row saying not measured has not been run yet."
)
# The fault suite is tests, not a benchmark: no script writes its row, so every run keeps it.
FAULT_ROW = [
    "fault suite: invariant violations ([docs/reliability.md](reliability.md#results))",
    "0",
    "0 in the last recorded run",
    "yes",
    "`bin/test tests/faults`",
]


@dataclass(frozen=True)
class Figure:
    """One row of the summary. A benchmark that has targets returns these from its results
    and passes them to finish() or write_section() with its `bench/run` name; bench/health.py
    adds its rows the same way, under its own name."""

    figure: str
    target: str
    result: str
    met: bool | None  # None: not measured (its result says so)


def anchor(title: str) -> str:
    """The link target that GitHub and most renderers give a `## ` heading."""
    words = re.sub(r"[^\w\- ]", "", title.removeprefix("## ").strip().lower())
    return "#" + words.replace(" ", "-")


def summary_row(bench: str, title: str, figure: Figure) -> list[str]:
    met = {True: "yes", False: "**no**", None: "-"}[figure.met]
    link = f"[{figure.figure}]({anchor(title)})"
    return [link, figure.target, figure.result, met, f"`bench/run {bench}`"]


def summary_rows(text: str) -> list[list[str]]:
    """The rows of the summary table in `text` (none when it has no summary)."""
    found = _section_pattern(SUMMARY).search(text)
    if not found:
        return []
    lines = [line for line in found.group(0).splitlines() if line.startswith("|")]
    return [_cells(line) for line in lines[2:]]  # past the header and its rule


def merge_rows(rows: list[list[str]], bench: str, new: list[list[str]]) -> list[list[str]]:
    """`rows` with the benchmark's own replaced by `new`, where the first of them stood, or
    `new` appended when it had none; every other row kept as it is."""
    own = f"`bench/run {bench}`"
    mine = [i for i, row in enumerate(rows) if row[-1] == own]
    if not mine:
        return [*rows, *new]
    kept = [row for row in rows if row[-1] != own]
    at = mine[0]
    return [*kept[:at], *new, *kept[at:]]


def with_summary(text: str, rows: list[list[str]]) -> str:
    """`text` with its summary section holding `rows`: replaced where it is, or put before
    the first section."""
    rows_text = table(SUMMARY_HEADER, rows, align=":---")
    summary = f"{SUMMARY}\n\n{paragraph(SUMMARY_LEAD)}\n\n{rows_text}\n"
    pattern = _section_pattern(SUMMARY)
    if pattern.search(text):
        return pattern.sub(lambda _: summary + "\n", text, count=1)
    first = re.search(r"^## ", text, re.M)
    at = first.start() if first else len(text)
    head = text[:at].rstrip("\n") + "\n\n"
    return head + summary + ("\n" + text[at:] if first else "")


def file_header() -> str:
    return (
        "# Benchmarks\n\n"
        + paragraph(
            "`bench/run` runs every benchmark in turn, each writing its own section here and its"
            " rows of the summary; `bench/run NAME ...` runs some, `bench/run --dry-run` prints the"
            " commands. Each starts what it needs (daphne, Celery, the fleet) on a database and a"
            " Redis database of its own. The machine is shared: each section records the load"
            " average, and the figures move with it."
        )
        + "\n"
    )


def write_section(
    path: Path,
    title: str,
    section: str,
    bench: str | None = None,
    figures: Iterable[Figure] = (),
) -> None:
    """Replace the section headed `title` (up to the next `## `) or append it, and with `bench`
    replace that benchmark's rows of the summary by `figures`; the rest of the file is left as
    it is."""
    assert section.startswith(title + "\n")
    text = path.read_text() if path.exists() else file_header()
    if not _section_pattern(SUMMARY).search(text):
        text = with_summary(text, [FAULT_ROW])
    if bench is not None:
        new = [summary_row(bench, title, f) for f in figures]
        text = with_summary(text, merge_rows(summary_rows(text), bench, new))
    pattern = _section_pattern(title)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def _section_pattern(title: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.M | re.S)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def table(header: list[str], rows: list[list], align: str = "---:") -> str:
    """A markdown table, its columns right-aligned (figures) unless `align` says otherwise."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def finish(
    header: list[str],
    rows: list[list],
    write: Path | None,
    title: str,
    section: Callable[[], str],
    crashed: bool,
    bench: str | None = None,
    figures: Iterable[Figure] = (),
) -> None:
    """A script's end: its table printed, its section and its summary rows written with
    --write (made only then: it asks the database about the machine), exit status 1 if a
    consumer or task crashed."""
    print(table(header, rows), flush=True)
    if write:
        write_section(write, title, section(), bench, figures)
    if crashed:
        sys.exit(1)


def raise_open_files(workers: int) -> int:
    """Each worker of an in-process fleet holds a socket here and one in daphne (a child: it
    inherits the limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * workers + 1024
    if soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft < wanted:
        raise SystemExit(f"open-file limit {soft} is too low for {workers} workers")
    return soft
