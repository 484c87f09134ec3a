"""simulate_workers: a fleet of reference workers (workers.simulator) against a live server,
for load and end-to-end runs. The simulated workers are ordinary Worker rows."""

import asyncio
import math
import os
import resource
import signal
from collections import Counter

from django.core.management.base import CommandError
from django.db import connection, transaction

from gradient import heap
from gradient.jobs.management.json_command import JsonCommand, Once, checked_name
from gradient.jobs.models import Project
from gradient.jobs.submission import column_range
from workers.models import Worker, hash_token
from workers.simulator import DEFAULT_URL, Fleet, WorkerConfig

# A worker the simulator created carries this endpoint (and reports it again on every connect),
# so a later run may re-issue its token but never takes over a real worker's name.
SIM_ENDPOINT = "sim://{name}"
TTY_REFRESH_SECS = 0.5
LOG_REFRESH_SECS = 5.0
EVENTS_KEPT = 100  # per worker in memory; --log keeps them all
MAX_WORKERS = 100_000  # a socket each, in one process
# What the server stores as a worker's slots (and the protocol's SlotCount allows).
_, MAX_SLOTS = column_range(Worker, "max_concurrent_builds")


class Command(JsonCommand):
    help = (
        "Create (or re-issue the tokens of) simulated workers PREFIX-0..N-1 and run them as a"
        " fleet against the server, showing live progress on stderr. Prints a JSON summary"
        " when stopped (--duration, Ctrl-C or SIGTERM)."
    )

    def add_arguments(self, parser):
        add = parser.add_argument
        add("--count", action=Once, type=int, required=True, metavar="N")
        add("--prefix", action=Once, default="sim")
        add("--zones", action=Once, metavar="A,B", help="assigned round robin")
        add("--arch", action=Once, default="x86_64-linux", metavar="ARCH1,ARCH2")
        add("--features", action=Once, metavar="F1+F2")
        add("--max-builds", action=Once, type=int, default=1, metavar="N")
        add("--max-evals", action=Once, type=int, default=1, metavar="N")
        add("--no-eval", action=Once, nargs=0, const=True, default=False)
        add("--no-build", action=Once, nargs=0, const=True, default=False)
        add("--fetch", action=Once, nargs=0, const=True, default=False)
        add("--job-secs", action=Once, default="0.5-2", metavar="LO-HI")
        add("--fail-rate", action=Once, type=float, default=0.0, metavar="P")
        add("--reject-rate", action=Once, type=float, default=0.0, metavar="P")
        add(
            "--flaky-rate",
            action=Once,
            type=float,
            default=0.0,
            metavar="P",
            help="this share of the workers are flaky: they reject or lose their cluster members",
        )
        add("--seed", action=Once, type=int, metavar="N")
        add(
            "--url",
            action=Once,
            default=DEFAULT_URL,
            metavar="URL1,URL2",
            help="one server, or several tried in turn on each reconnect",
        )
        add("--duration", action=Once, type=float, metavar="SECS")
        add("--log", action=Once, metavar="FILE", help="append one JSON line per event")
        add("--projects", action=Once, metavar="P1,P2", help="default: every project")

    def run(self, **options) -> dict:
        # Everything is checked before anything is written.
        names = worker_names(options["prefix"], options["count"])
        configs = worker_configs(names, options)
        check_run_options(options)
        projects = options["projects"]
        projects = None if projects is None else split_list(projects, ",", "--projects")
        tokens = issue_tokens(names, projects)
        connection.close()  # the fleet may run for hours without touching the database
        raise_fd_limit(len(names))
        heap.tune()  # hundreds of sessions for hours, like the server's own processes
        fleet = Fleet(
            [(name, tokens[name], configs[name]) for name in names],
            url=split_list(options["url"], ",", "--url"),
            log_path=options["log"],
            ramp_secs=min(len(names) * 0.002, 2.0),  # no thundering herd at the handshake
        )
        asyncio.run(self.drive(fleet, options["duration"]))
        return summary(fleet)

    async def drive(self, fleet: Fleet, duration: float | None) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, fleet.stop)
        progress = asyncio.create_task(self.show_progress(fleet))
        try:
            await fleet.run(duration)
        finally:
            progress.cancel()
            self.status(fleet, final=True)

    async def show_progress(self, fleet: Fleet) -> None:
        period = TTY_REFRESH_SECS if self.stderr.isatty() else LOG_REFRESH_SECS
        while True:
            await asyncio.sleep(period)
            self.status(fleet)

    def status(self, fleet: Fleet, final: bool = False) -> None:
        c = fleet.counters()
        elapsed = int(fleet.elapsed)
        line = (
            f"{elapsed // 3600}:{elapsed // 60 % 60:02}:{elapsed % 60:02}"
            f"  connected {c['connected']}/{c['workers']}  idle {c['idle']}"
            f"  held {c['held']}  running {c['running']}  completed {c['completed']}"
            f"  failed {c['failed']}  rejected {c['rejected']}"
        )
        if self.stderr.isatty():  # one line, rewritten in place
            line = f"\r{line}\x1b[K" + ("\n" if final else "")
        else:
            line += "\n"
        self.stderr.write(line, style_func=str, ending="")
        self.stderr.flush()


def worker_names(prefix: str, count: int) -> list[str]:
    if not 1 <= count <= MAX_WORKERS:
        raise CommandError(f"--count must be 1 to {MAX_WORKERS}, not {count}")
    if not prefix.strip():
        raise CommandError("--prefix must not be empty")
    checked_name(Worker, f"{prefix}-{count - 1}", "worker")
    return [f"{prefix}-{i}" for i in range(count)]


def worker_configs(names: list[str], o: dict) -> dict[str, WorkerConfig]:
    zones = split_list(o["zones"], ",", "--zones") or [None]
    base = dict(
        architectures=tuple(split_list(o["arch"], ",", "--arch")),
        system_features=tuple(split_list(o["features"], "+", "--features")),
        max_builds=slot_count(o["max_builds"], "--max-builds"),
        max_evals=slot_count(o["max_evals"], "--max-evals"),
        eval=not o["no_eval"],
        build=not o["no_build"],
        fetch=o["fetch"],
        job_secs=job_secs(o["job_secs"]),
        fail_rate=rate(o["fail_rate"], "--fail-rate"),
        reject_rate=rate(o["reject_rate"], "--reject-rate"),
        seed=o["seed"],
        max_events=EVENTS_KEPT,
    )
    if not base["architectures"]:
        raise CommandError("--arch must name at least one architecture")
    flaky = flaky_workers(names, rate(o["flaky_rate"], "--flaky-rate"))
    configs = {
        name: WorkerConfig(
            **{**base, **flaky.get(name, {})},
            zone=zones[i % len(zones)],
            endpoint=sim_endpoint(name),
        )
        for i, name in enumerate(names)
    }
    sample = configs[names[0]]
    if sample.slots("eval") + sample.slots("build") == 0:
        raise CommandError("these workers would have no slot: give them evals, builds or fetch")
    return configs


# The two ways a flaky machine fails a cluster, taken in turn by the flaky workers: it refuses
# every member, or it loses them with its connection at the start.
FLAKY_WAYS = {"reject": {"reject_rate": 1.0}, "lose": {"loses_members": True}}


def flaky_workers(names: list[str], share: float) -> dict[str, dict]:
    """round(share x count) of the workers, spread evenly over the names, each with its way of
    failing (FLAKY_WAYS, in turn): name -> WorkerConfig overrides."""
    count = round(share * len(names))
    chosen = [names[i * len(names) // count] for i in range(count)] if count else []
    ways = list(FLAKY_WAYS.values())
    return {name: ways[i % len(ways)] for i, name in enumerate(chosen)}


def check_run_options(o: dict) -> None:
    for url in split_list(o["url"], ",", "--url"):
        if not url.startswith(("ws://", "wss://")):
            raise CommandError(f"--url must be ws:// or wss:// URLs, not {url!r}")
    duration = o["duration"]
    if duration is not None and not (duration > 0 and math.isfinite(duration)):
        raise CommandError(f"--duration must be a positive number of seconds, not {duration}")
    log = o["log"]
    if log is not None:
        folder = os.path.dirname(os.path.abspath(log))
        if os.path.isdir(log) or not os.access(folder, os.W_OK):
            raise CommandError(f"--log {log!r} is not a writable file path")


def split_list(value: str | None, sep: str, option: str) -> list[str]:
    if value is None:
        return []
    items = value.split(sep)
    if any(not item.strip() for item in items):
        raise CommandError(f"{option} {value!r} has an empty item")
    return items


def slot_count(value: int, option: str) -> int:
    if value < 0:
        raise CommandError(f"{option} must not be negative, not {value}")
    if value > MAX_SLOTS:
        raise CommandError(f"{option} must be at most {MAX_SLOTS}, not {value}")
    return value


def rate(value: float, option: str) -> float:
    if not 0 <= value <= 1:
        raise CommandError(f"{option} must be between 0 and 1, not {value}")
    return value


def job_secs(value: str) -> tuple[float, float]:
    """`LO-HI` or a single number of seconds."""
    lo, _, hi = value.partition("-")
    try:
        bounds = (float(lo), float(hi or lo))
    except ValueError:
        raise CommandError(f"--job-secs must be LO-HI seconds, not {value!r}") from None
    if not all(math.isfinite(b) for b in bounds) or not 0 <= bounds[0] <= bounds[1]:
        raise CommandError(f"--job-secs must be 0 <= LO <= HI, not {value!r}")
    return bounds


def sim_endpoint(name: str) -> str:
    return SIM_ENDPOINT.format(name=name)


def issue_tokens(names: list[str], projects: list[str] | None) -> dict[str, str]:
    """Creates the workers, or re-issues the tokens of those this simulator created before (a
    re-issue also lifts a revocation: the old token is dead either way). One transaction."""
    tokens = {name: Worker.new_token() for name in names}
    with transaction.atomic(durable=True):
        allowed = project_rows(projects)
        existing = {w.name: w for w in Worker.objects.select_for_update().filter(name__in=names)}
        foreign = sorted(n for n, w in existing.items() if w.endpoint != sim_endpoint(n))
        if foreign:
            raise CommandError(f"worker {foreign[0]!r} exists and was not made by the simulator")
        for name, worker in existing.items():
            worker.token_hash = hash_token(tokens[name])
            worker.revoked_at = None
            worker.all_projects = projects is None
        Worker.objects.bulk_update(existing.values(), ["token_hash", "revoked_at", "all_projects"])
        created = Worker.objects.bulk_create(
            Worker(
                name=name,
                token_hash=hash_token(tokens[name]),
                all_projects=projects is None,
                endpoint=sim_endpoint(name),
            )
            for name in names
            if name not in existing
        )
        set_projects([*existing.values(), *created], allowed)
    return tokens


def project_rows(names: list[str] | None) -> list[Project]:
    if names is None:
        return []
    rows = list(Project.objects.filter(name__in=names))
    missing = set(names) - {p.name for p in rows}
    if missing:
        raise CommandError(f"unknown project(s): {', '.join(map(repr, sorted(missing)))}")
    return rows


def set_projects(workers: list[Worker], projects: list[Project]) -> None:
    through = Worker.projects.through
    through.objects.filter(worker__in=workers).delete()
    through.objects.bulk_create(
        through(worker_id=w.pk, project_id=p.pk) for w in workers for p in projects
    )


def raise_fd_limit(workers: int) -> None:
    """One socket per worker: lift the soft open-file limit toward the hard one if needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = workers + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        cap = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))


def summary(fleet: Fleet) -> dict:
    c = fleet.counters()
    ended = Counter(w.stopped_reason for w in fleet.workers)
    return {
        "workers": c["workers"],
        "elapsed_secs": round(fleet.elapsed, 1),
        "connections": sum(w.connections for w in fleet.workers),
        "completed": c["completed"],
        "failed": c["failed"],
        "rejected": c["rejected"],
        "flaky": sum(w.config.reject_rate == 1.0 or w.config.loses_members for w in fleet.workers),
        "ended": dict(ended),
    }
