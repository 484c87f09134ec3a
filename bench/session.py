"""What a connected session costs the server per call, at two sizes of fleet and queue.

The method is in docs/benchmarks.md, "Session costs".
"""

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 12
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_session"
WARMUP_CALLS = 200
TARGET_GROWTH = 1.5  # CPU per call at the largest size over the smallest, every operation
OPERATIONS = ("touch", "slot refresh", "slot record", "resend", "group join", "thread hop")


def populate(workers: int, queued: int) -> list:
    """The fleet and the queue, in bulk; returns the workers."""
    from django.db import connection
    from django.utils import timezone

    from clusters.models import ClusterStatus
    from gradient.jobs.models import BuildStatus, DerivationBuild, Project
    from workers.models import IdleSlot

    now = timezone.now()
    members_of, singles_of = Project.objects.bulk_create(
        [Project(name="bench-members"), Project(name="bench-singles")]
    )
    fleet = common.make_workers(
        (f"w-{i}" for i in range(workers)),
        members_of,
        connected=True,
        architectures=["x86_64-linux"],
        max_concurrent_builds=1,
        can_build=True,
    )
    IdleSlot.objects.bulk_create(IdleSlot(worker=w, kind="build", recorded_at=now) for w in fleet)
    DerivationBuild.objects.bulk_create(
        (
            DerivationBuild(project=singles_of, status=BuildStatus.QUEUED)
            for _ in range(queued // 2)
        ),
        batch_size=5000,
    )
    # Seen able to start by a pass: only such clusters' members are offered. Behind them, as
    # many finished clusters (history until the retention pass), which no walk may read.
    queued_ = {"project": members_of, "status": ClusterStatus.QUEUED, "waiting_since": now}
    finished = {"project": members_of, "status": ClusterStatus.COMPLETED}
    members = [(f"m{n}", "build", {}, {}) for n in range(2)]
    done = [(f"m{n}", "build", {"status": BuildStatus.COMPLETED}, {}) for n in range(2)]
    common.make_clusters([(queued_, members)] * (queued // 4) + [(finished, done)] * (queued // 4))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return fleet


def first_requests(fleet: list) -> dict:
    """Every worker's first RequestJob: its head's members offered (job_score rows). Returns
    each worker's offers as its session keeps them."""
    from django.db import connection

    from sessions.request_job import read_and_answer
    from workers.offers import Offered

    offered = {}
    for worker in fleet:
        offered[worker.pk] = Offered()
        read_and_answer(worker, offered[worker.pk], "build", resend=False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM job_score")
        rows = cursor.fetchone()[0]
        cursor.execute("VACUUM ANALYZE")
        cursor.execute("CHECKPOINT")
    return {"offered": offered, "job_score": rows}


class Meter:
    """CPU seconds of this process, the database's backends and the Redis server."""

    def __init__(self, redis, database_url: str):
        import psycopg

        self.redis = redis
        # A connection of its own, not Django's: it is read from the event loop too.
        self.db = psycopg.connect(database_url, autocommit=True)

    def _backends(self) -> dict[int, float]:
        rows = self.db.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchall()
        return {pid: common.cpu_secs(pid, children=False) for (pid,) in rows}

    def _redis(self) -> float:
        info = self.redis.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def start(self) -> None:
        self.backends = self._backends()
        self.redis_cpu = self._redis()
        self.process = time.process_time()
        self.wall = time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall
        process = time.process_time() - self.process
        redis = self._redis() - self.redis_cpu
        backends = self._backends()
        # A backend first seen now (a frame thread's connection) spent all its CPU since.
        postgres = sum(secs - self.backends.get(pid, 0.0) for pid, secs in backends.items())
        return {"wall": wall, "process": process, "postgres": postgres, "redis": redis}


def operations(fleet: list, offered: dict) -> dict[str, Callable[[int], object]]:
    """Each operation as a call on the i-th worker (round robin over the fleet)."""
    from channels.layers import get_channel_layer

    from gradient.wire.groups import worker_group
    from sessions.connection import touch
    from sessions.request_job import read_and_answer
    from sessions.threads import db
    from workers.assignment import record_idle

    layer = get_channel_layer()
    hop = db(lambda: None)

    def nth(i):
        return fleet[i % len(fleet)]

    def resend(i):
        worker = nth(i)
        head, answered, assign = read_and_answer(worker, offered[worker.pk], "build", True)
        assert answered and assign is None and head.offer is None, "the resend found work"

    return {
        "touch": lambda i: touch(nth(i).pk, nth(i).channel_name),
        "slot refresh": lambda i: record_idle(nth(i).pk, "build", resend=True),
        "slot record": lambda i: record_idle(nth(i).pk, "build", resend=False),
        "resend": resend,
        "group join": lambda i: layer.group_add(worker_group(nth(i).pk), nth(i).channel_name),
        "thread hop": lambda i: hop(),
    }


def timed(call: Callable[[int], object], calls: int, meter: Meter) -> dict[str, float]:
    """The calls' costs, per call in ms; an awaitable's calls run on one event loop."""
    probe = call(0)
    if asyncio.iscoroutine(probe):

        async def loop(first, count):
            for i in range(first, first + count):
                await call(i)

        async def both():
            await probe
            await loop(1, WARMUP_CALLS)
            meter.start()
            await loop(WARMUP_CALLS + 1, calls)
            return meter.stop()

        spent = asyncio.run(both())
    else:
        for i in range(1, WARMUP_CALLS + 1):
            call(i)
        meter.start()
        for i in range(WARMUP_CALLS + 1, WARMUP_CALLS + 1 + calls):
            call(i)
        spent = meter.stop()
    return {part: 1000 * secs / calls for part, secs in spent.items()}


def bench_size(workers: int, queued: int, calls: int, redis, database_url: str) -> list[dict]:
    common.ensure_database()
    fleet = populate(workers, queued)
    first = first_requests(fleet)
    meter = Meter(redis, database_url)
    size = {"workers": workers, "queued": queued, "calls": calls, "job_score": first["job_score"]}
    return [
        {"operation": name, **size, **timed(call, calls, meter)}
        for name, call in operations(fleet, first["offered"]).items()
    ]


HEADER = (
    "operation | workers | queued | calls | wall ms/call | CPU ms/call: this process"
    " | PostgreSQL | Redis | all"
)


def cpu(r: dict) -> float:
    return r["process"] + r["postgres"] + r["redis"]


def table_row(r: dict) -> list:
    sizes = [f"{r[k]:,}" for k in ("workers", "queued", "calls")]
    return [
        r["operation"],
        *sizes,
        *(f"{r[k]:.3f}" for k in ("wall", "process", "postgres", "redis")),
        f"{cpu(r):.3f}",
    ]


def growth(rows: list[dict]) -> dict[str, float]:
    """Each operation's CPU per call at the largest size over the smallest."""
    out = {}
    for name in OPERATIONS:
        of = sorted((r for r in rows if r["operation"] == name), key=lambda r: r["workers"])
        if len(of) >= 2 and cpu(of[0]) > 0:
            out[name] = cpu(of[-1]) / cpu(of[0])
    return out


def figures(rows: list[dict]) -> list[common.Figure]:
    grown = growth(rows)
    if not grown:
        return []
    worst = max(grown, key=grown.get)
    sizes = sorted({(r["workers"], r["queued"]) for r in rows})
    (w0, q0), (w1, q1) = sizes[0], sizes[-1]
    return [
        common.Figure(
            f"session costs: CPU per call at {w1:,} workers and {q1:,} queued over"
            f" {w0:,} and {q0:,}, the most grown operation",
            f"≤ {TARGET_GROWTH:g}x",
            f"{grown[worst]:.2f}x ({worst})",
            grown[worst] <= TARGET_GROWTH,
        )
    ]


def main() -> None:
    parser = common.parser(__doc__, DATABASE_URL, REDIS_DB)
    parser.add_argument("--sizes", default="100x500,5000x20000", help="WORKERSxQUEUED,...")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per operation")
    args = parser.parse_args()
    common.start(args)
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    rows = []
    for workers, queued in common.parse_grid(args.sizes):
        rows += bench_size(workers, queued, args.calls, client, args.database)
    job_scores = ", ".join(
        f"{r['job_score']:,} at {r['workers']:,} workers" for r in rows if r["operation"] == "touch"
    )
    common.finish(
        args,
        "session",
        "## Session costs",
        common.table(HEADER, [table_row(r) for r in rows]),
        [f"job_score rows: {job_scores}."],
        figures(rows),
    )


if __name__ == "__main__":
    os.environ.setdefault("GRADIENT_LOG_LEVEL", "WARNING")
    main()
