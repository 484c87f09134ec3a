"""What the benchmark scripts share: set-up, the stack, fleets, the one percentile and their
figures' blocks in docs/benchmarks.md. Call start(args) before importing the project: Django
reads DATABASE_URL once, at set-up."""

import argparse
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import timeit
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench"
LOAD_AT_START = ""  # set by start()

# Set-up

# Options more than one script takes: type and help.
OPTIONS = {
    "warmup": (float, "seconds before the window"),
    "window": (float, "seconds measured"),
    "connect_timeout": (float, "seconds to wait for the fleet"),
    "settle_load": (float, "wait (5 minutes at most) for a load average below this; 0: not"),
    "runs": (int, "runs of each size, in turn; the targets take the median"),
}


def parser(doc: str, database: str = DEFAULT_DATABASE_URL, redis_db: int = 9, **defaults):
    """Every script's arguments, and those of OPTIONS it names, with their defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--database", default=database, help="emptied by the run")
    p.add_argument("--redis-db", type=int, default=redis_db, help="flushed by the run")
    p.add_argument("--write", type=Path, help="update the figures in this markdown file")
    for name, default in defaults.items():
        kind, text = OPTIONS[name]
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)
    return p


def start(args) -> None:
    """Django set up on the script's database and Redis database, never ambient ones."""
    global LOAD_AT_START
    LOAD_AT_START = load()
    print(command(), flush=True)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from gradient.redis_db import redis_url  # reads no setting: Django is not set up yet

    os.environ["DATABASE_URL"] = args.database
    os.environ["REDIS_URL"] = redis_url(args.redis_db)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    import django

    django.setup()


def command() -> str:
    return shlex.join([".venv/bin/python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def ensure_database() -> None:
    """The bench database made, migrated (afresh when its migrations changed) and emptied."""
    import psycopg
    from django.core.management import call_command
    from django.db import connection
    from psycopg import sql

    name = connection.settings_dict["NAME"]
    database = sql.Identifier(name)
    with psycopg.connect(os.environ["DATABASE_URL"], dbname="postgres", autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            admin.execute(sql.SQL("CREATE DATABASE {}").format(database))
        try:
            call_command("migrate", verbosity=0)
        except Exception as exc:
            print(f"migrate failed ({exc!r}); recreating {name}", flush=True)
            connection.close()
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(database))
            admin.execute(sql.SQL("CREATE DATABASE {}").format(database))
            call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(project_tables())} RESTART IDENTITY CASCADE")


def project_tables() -> list[str]:
    from django.apps import apps

    labels = ("jobs", "workers", "clusters")
    models = (
        m for a in labels for m in apps.get_app_config(a).get_models(include_auto_created=True)
    )
    return sorted({model._meta.db_table for model in models})


def analyze(vacuum: bool = False) -> None:
    """Statistics as autovacuum keeps them: an emptied database is planned as for empty tables."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"{'VACUUM ' if vacuum else ''}ANALYZE {', '.join(project_tables())}")


def warm_up(secs: float) -> None:
    analyze()
    time.sleep(secs / 2)
    analyze()
    time.sleep(secs / 2)


def backend_pid() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def count_by(rows, field: str) -> dict:
    from django.db.models import Count

    return dict(rows.values_list(field).annotate(n=Count("pk")))


def connected(prefix: str = "") -> int:
    from workers.models import Worker

    return Worker.objects.filter(channel_name__isnull=False, name__startswith=prefix).count()


def settle(below: float, most_secs: float = 300.0) -> None:
    """A CHECKPOINT (no dirty pages of the last run written in this one), then a wait for a
    load average below `below`."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")
    connection.close()
    deadline = time.monotonic() + most_secs
    while below and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def load_span(before: str | None = None) -> str:
    return f"{before or LOAD_AT_START} at the start, {load()} at the end"


def machine() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        pg = cursor.fetchone()[0]
    # How fast this shared host runs Python right now.
    loop = min(timeit.repeat("sum(range(10_000_000))", number=1, repeat=3))
    return f"{os.cpu_count()} cores (reference loop {loop:.2f} s), PostgreSQL {pg.split()[0]}"


def parse_grid(text: str) -> list[tuple[int, int]]:
    """ "100x500,1000x5000" -> [(100, 500), (1000, 5000)]"""
    return [tuple(int(n) for n in point.split("x")) for point in text.split(",")]


def parse_ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


# The stack: daphne and Celery as real processes


def process_env(**extra) -> dict:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "gradient.settings",
        "PYTHONUNBUFFERED": "1",
        **{k: str(v) for k, v in extra.items()},
    }


def flush_redis(redis_url: str | None = None) -> None:
    import redis

    redis.Redis.from_url(redis_url or os.environ["REDIS_URL"]).flushdb()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def until(predicate: Callable, timeout: float, what: str, tick: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:g} s")
        time.sleep(tick)
    return found


class Processes:
    """The stack's processes, each in its own session (a kill reaches its children)."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs = env, logs
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.names: dict[int, str] = {}  # pid -> the name given to start()
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}/proto"
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
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
        return [proc.pid for proc, _ in self.procs if self.names[proc.pid] in names]

    def daphne(self) -> subprocess.Popen:
        """The README's command: a daphne per core on one socket."""
        python = str(VENV_BIN / "python")
        proc = self.start(
            "daphne", python, "-m", "gradient.serve", "-b", "127.0.0.1", "-p", str(self.port)
        )

        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"daphne exited with {proc.returncode}")
            return listening(self.port)

        until(up, 30.0, f"daphne listening on {self.port}")
        return proc

    def celery(self) -> None:
        celery = str(VENV_BIN / "celery")
        name = f"bench-{os.getpid()}@%h"
        self.start(
            "celery-worker",
            *(celery, "-A", "gradient", "worker", "-c", "2", "-l", "info"),
            *("--without-mingle", "--without-gossip", "-n", name),
        )
        log = self.logs / "celery-worker.log"
        until(lambda: "ready." in log.read_text(errors="replace"), 60.0, "ready Celery", 0.1)
        beat_schedule = str(self.logs / "beat-schedule")
        self.start(
            "celery-beat", celery, "-A", "gradient", "beat", "-l", "info", "-s", beat_schedule
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
                self.kill(proc)
            log.close()

    def groups(self) -> dict[str, list[int]]:
        return {"daphne": self.pids("daphne"), "celery": self.pids("celery-worker", "celery-beat")}

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def problems(self) -> tuple[list[str], int]:
        """Crash lines and tracebacks; read before stop(), which may kill a task mid-way."""
        lines = f"{self.log_text('daphne')}\n{self.log_text('celery-worker')}".splitlines()
        crashes = ("Exception inside application", "raised unexpected")
        crashed = [line for line in lines if any(c in line for c in crashes)]
        return crashed, sum(line.startswith("Traceback") for line in lines)


@contextmanager
def stack(name: str, celery: bool = True, logs: Path | None = None, **settings) -> Iterator:
    """daphne and, with `celery`, Celery as in production, with `settings` in their env."""
    env = process_env(**settings)
    flush_redis()
    procs = Processes(env, logs or Path(tempfile.mkdtemp(prefix=f"bench-{name}-")))
    try:
        procs.daphne()
        if celery:
            procs.celery()
        yield procs
    finally:
        procs.stop()
        flush_redis()
        print(f"logs in {procs.logs}", flush=True)


def crash_fact(crashes: int, tracebacks: int | None = None, celery: bool = True) -> str:
    where = "daphne's log" + (", `raised unexpected` in Celery's" if celery else "")
    text = f"Consumers or tasks that crashed (`Exception inside application` in {where}): {crashes}"
    return text + ("." if tracebacks is None else f"; tracebacks of any kind there: {tracebacks}.")


def raise_open_files(workers: int) -> None:
    """A socket here and one in daphne (a child: it inherits the limit) per worker."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * workers + 1024
    if hard != resource.RLIM_INFINITY and hard < wanted:
        raise SystemExit(f"open-file limit {hard} is too low for {workers} workers")
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def in_memory_layer() -> None:
    """For benches without sessions: nothing listens on the workers' groups."""
    import logging

    from channels.layers import channel_layers
    from django.conf import settings

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    logging.getLogger("clusters").setLevel(logging.WARNING)


# CPU


def cpu_secs(pid: int, children: bool = True) -> float:
    """CPU seconds of a process and its live descendants (Celery's pool)."""
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


class CpuMeter:
    """CPU seconds between start() and stop() of each group, this process alone (its children
    are the stack) and the bench database's backends as "postgres", to their last observe()."""

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
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND NOT pid = ANY(%s)",
                [list(self.exclude)],
            )
            backends = {row[0] for row in cursor.fetchall()}
        for pid in backends | set(self.last):
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


class Feeder:
    """top_up() every `tick` seconds from a thread until `stop`; `error` for the caller."""

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


def closing(fn: Callable) -> Callable:
    """fn, then its thread's connection closed: for asyncio.to_thread."""

    def run():
        from django.db import connection

        try:
            return fn()
        finally:
            connection.close()

    return run


# Fleets


def token(name: str) -> str:
    return f"token-{name}"


def make_workers(
    names: Iterable[str],
    project=None,
    connected: bool = False,
    each: Callable[[int], dict] | None = None,
    **fields,
) -> list:
    """Worker rows with `fields` and each(i)'s; `project` (or project(i)) the one they take;
    `connected`: as if a session held each."""
    from django.utils import timezone

    from workers.models import Worker, hash_token

    now = timezone.now()
    pick = project if callable(project) else (lambda i: project)

    def row(i: int, name: str):
        own = each(i) if each else {}
        if connected:
            own.update(channel_name=f"bench.channel!{i}", connected_at=now, last_seen_at=now)
        if pick(i) is not None:
            own["all_projects"] = False
        return Worker(name=name, token_hash=hash_token(token(name)), **fields, **own)

    made = Worker.objects.bulk_create((row(i, n) for i, n in enumerate(names)), batch_size=5000)
    through = Worker.projects.through
    through.objects.bulk_create(
        through(worker_id=w.pk, project_id=p.pk)
        for i, w in enumerate(made)
        if (p := pick(i)) is not None
    )
    return made


def make_clusters(shapes: Iterable[tuple[dict, list[tuple]]], batch_size: int = 5000):
    """From (fields, [(role, "eval" or "build", job fields, member fields)]): clusters, jobs."""
    from clusters.models import ClusterJob, ClusterMember
    from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation

    shapes = list(shapes)
    clusters = ClusterJob.objects.bulk_create(
        (ClusterJob(**fields) for fields, _ in shapes), batch_size=batch_size
    )
    kinds = {
        "eval": (Evaluation, "evaluation", {}),
        "build": (DerivationBuild, "derivation_build", {"status": BuildStatus.QUEUED}),
    }
    jobs, members = [], []
    for c, (_, rows) in zip(clusters, shapes, strict=True):
        for role, kind, job, extra in rows:
            model, field, default = kinds[kind]
            jobs.append(model(project=c.project, **{**default, **job}))
            members.append(ClusterMember(cluster_job=c, role=role, **extra, **{field: jobs[-1]}))
    for model in (Evaluation, DerivationBuild):
        model.objects.bulk_create([j for j in jobs if isinstance(j, model)], batch_size)
    ClusterMember.objects.bulk_create(members, batch_size=batch_size)
    return clusters, jobs


# Figures


def percentile(xs: Iterable[float], p: float) -> float:
    """Linear between the closest ranks (numpy's default): every benchmark's, so tails compare."""
    xs = sorted(xs)
    at = (len(xs) - 1) * p / 100
    low = math.floor(at)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (at - low)


def median_p(xs: Iterable[float], p: float) -> tuple[float, float] | None:
    xs = list(xs)
    return (percentile(xs, 50), percentile(xs, p)) if xs else None


def median_text(values: list[float], digits: int = 1) -> str:
    """The median of the runs, with their range: a target is judged on the median."""
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    low, high = min(values), max(values)
    return f"{mid:.{digits}f} (median of {len(values)}: {low:.{digits}f} to {high:.{digits}f})"


def table(header: str, rows: list[list], align: str = "---:") -> str:
    header = header.split(" | ")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Figure:
    figure: str
    target: str
    result: str
    met: bool | None  # None: not measured (its result says so)


def below(figure: str, limit: float, value: float, unit: str = "ms", note: str = "") -> Figure:
    """A figure whose target is a limit it must stay under."""
    return Figure(figure, f"< {limit:.0f} {unit}", f"{value:.1f} {unit}{note}", value < limit)


# docs/benchmarks.md: each benchmark's figures sit between these markers in its section, the
# method's prose around them is the doc's own; the summary's rows sit between SUMMARY's.
MARK = "<!-- figures: {} -->"
END = "<!-- /figures -->"
SUMMARY = MARK.format("summary")
SUMMARY_HEADER = "figure | target | result | met | command"
WIDTH = 100  # a fact longer than this is wrapped, so no line needs scrolling sideways


def finish(
    args,
    bench: str,
    title: str,
    tables: str,
    facts: Iterable[str] = (),
    figures: Iterable[Figure] = (),
    load: str | None = None,
    crashed: bool = False,
) -> None:
    """Tables printed; with --write, its block (tables, facts, command, date, machine, load)
    and summary rows written; exit status 1 if something crashed."""
    print(tables, flush=True)
    if args.write:
        facts = [
            *facts,
            f"Command: `{command()}`",
            f"Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"Machine: {machine()} on the same host over TCP, shared with other work"
            f" (load average {load or load_span()})",
        ]
        block = f"{tables}\n\n{bullets(facts)}"
        write(args.write, bench, title, block, list(figures))
    if crashed:
        sys.exit(1)


def bullets(items: Iterable[str]) -> str:
    wrap = textwrap.TextWrapper(WIDTH, "- ", "  ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(wrap.fill(item) for item in items)


def write(path: Path, bench: str, title: str, block: str, figures: list[Figure]) -> None:
    """The benchmark's block replaced (or its section appended), and its summary rows."""
    text = (
        path.read_text() if path.exists() else f"# Benchmarks\n\n## Summary\n\n{SUMMARY}\n{END}\n"
    )
    marked = f"{MARK.format(bench)}\n{block}\n{END}"
    pattern = _block(MARK.format(bench))
    if pattern.search(text):
        text = pattern.sub(lambda _: marked, text, count=1)
    else:
        text = f"{text.rstrip()}\n\n{title}\n\n{marked}\n"
    rows = [_cells(line) for line in _block(SUMMARY).search(text).group(1).splitlines()[2:]]
    own = f"`bench/run {bench}`"
    new = [summary_row(bench, title, f) for f in figures]
    mine = [i for i, row in enumerate(rows) if row[-1] == own]
    kept = [row for row in rows if row[-1] != own]
    at = mine[0] if mine else len(kept)
    rows = [*kept[:at], *new, *kept[at:]]
    summary = f"{SUMMARY}\n{table(SUMMARY_HEADER, rows, align=':---')}\n{END}"
    text = _block(SUMMARY).sub(lambda _: summary, text, count=1)
    path.write_text(text)


def summary_row(bench: str, title: str, figure: Figure) -> list[str]:
    met = {True: "yes", False: "**no**", None: "-"}[figure.met]
    words = re.sub(r"[^\w\- ]", "", title.removeprefix("## ").strip().lower())
    link = f"[{figure.figure}](#{words.replace(' ', '-')})"  # the anchor renderers give it
    return [link, figure.target, figure.result, met, f"`bench/run {bench}`"]


def _block(mark: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(mark)}\n(.*?)^{re.escape(END)}$", re.M | re.S)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]
