"""Worker health: a fleet with flaky workers runs clusters with quarantine on and off.

The method is in docs/benchmarks.md, "Worker health: quarantine with a flaky share".
"""

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 11
TIMEOUT_SECS = 900.0
MODES = {"on": 3, "off": 0}
# Short enough that a failed prepare or a lost member costs seconds, not the defaults' minutes.
SETTINGS = {
    "GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS": 1,
    "GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS": 5,
    "GRADIENT_CLUSTER_RETRY_BACKOFF_SECS": 1,
}


def make_fleet(count: int, flaky: int) -> list[tuple[str, str, object]]:
    from workers.management.commands.simulate_workers import flaky_workers
    from workers.simulator import WorkerConfig

    names = [f"health-{i:03d}" for i in range(count)]
    common.make_workers(names)
    ways = flaky_workers(names, flaky / count)
    base = WorkerConfig(
        eval=False,
        job_secs=(0.2, 0.5),
        score=lambda name, job: (0, 0),
        backoff=(0.2, 1.0),
        # A refusing worker asks again at its next heartbeat: every second, not every 10 s, so
        # that it is seated again as soon as a healthy one would be.
        heartbeat_secs=1.0,
        max_events=100,
    )
    return [(n, common.token(n), replace(base, **ways.get(n, {}))) for n in names]


def submit(clusters: int, size: int, budget: int) -> list[int]:
    from clusters.submission import parse_member, submit_cluster
    from gradient.jobs.models import Project

    Project.objects.create(name="health")
    members = [parse_member(f"node{i}:build") for i in range(size)]
    return [submit_cluster("health", members, retry_budget=budget)[0].pk for _ in range(clusters)]


def unfinished() -> int:
    from clusters.models import CLUSTER_ACTIVE, ClusterJob

    return ClusterJob.objects.filter(status__in=CLUSTER_ACTIVE).count()


async def serve(url: str, members, args) -> float:
    from asgiref.sync import sync_to_async

    from workers.simulator import Fleet

    fleet = Fleet(members, url=url, ramp_secs=0.5)
    running = asyncio.create_task(fleet.run())
    try:
        await asyncio.sleep(2.0)  # every worker connected and idle
        began = time.monotonic()
        await sync_to_async(submit)(args.clusters, args.size, args.retry_budget)
        while await sync_to_async(unfinished)():
            if time.monotonic() - began > TIMEOUT_SECS:
                break
            await asyncio.sleep(0.5)
        return time.monotonic() - began
    finally:
        fleet.stop()
        await running


def tally(seconds: float) -> dict:
    from django.db.models import Sum

    from clusters.models import ClusterAttempt, ClusterJob
    from gradient.jobs.models import DispatchedJob
    from workers.models import Worker

    clusters = ClusterJob.objects.count() or 1
    by_status = common.count_by(ClusterJob.objects, "status")
    started = ClusterJob.objects.aggregate(n=Sum("attempts"))["n"] or 0
    return {
        "completed": by_status.get("Completed", 0),
        "failed": by_status.get("Failed", 0),
        "unfinished": unfinished(),
        "attempts": ClusterAttempt.objects.count() / clusters,
        "started": started / clusters,
        "blamed": common.count_by(DispatchedJob.objects.filter(blame__isnull=False), "blame"),
        "quarantined": Worker.objects.filter(quarantined_by__isnull=False).count(),
        "seconds": seconds,
    }


def run_mode(after: int, args) -> dict:
    from django.db import connection

    common.ensure_database()
    members = make_fleet(args.workers, args.flaky)
    with common.stack(f"health-{after}", **SETTINGS, GRADIENT_QUARANTINE_AFTER=after) as procs:
        connection.close()  # the fleet's loop reaches the database from threads of its own
        seconds = asyncio.run(serve(procs.url, members, args))
    result = tally(seconds)
    result["crashes"], _ = procs.problems()
    return result


HEADER = (
    "quarantine | clusters Completed | clusters Failed | attempts per cluster"
    " | started attempts per cluster | blamed seats | workers quarantined"
    " | until all finished s"
)


def rows(results: dict) -> list[list]:
    out = []
    for mode, r in results.items():
        blamed = ", ".join(f"{how} {n}" for how, n in sorted(r["blamed"].items())) or "0"
        out.append(
            [
                f"{mode} (GRADIENT_QUARANTINE_AFTER={MODES[mode]})",
                r["completed"],
                f"{r['failed']}" + (f" ({r['unfinished']} unfinished)" if r["unfinished"] else ""),
                f"{r['attempts']:.2f}",
                f"{r['started']:.2f}",
                blamed,
                r["quarantined"],
                f"{r['seconds']:.0f}",
            ]
        )
    return out


def figures(results: dict) -> list[common.Figure]:
    on, off = results["on"], results["off"]
    return [
        common.Figure(
            "worker health: attempts per cluster, quarantine on against off",
            "fewer with it on",
            f"{on['attempts']:.2f} on, {off['attempts']:.2f} off",
            on["attempts"] < off["attempts"],
        ),
        common.Figure(
            "worker health: clusters Failed, quarantine on against off",
            "no more with it on",
            f"{on['failed']} on, {off['failed']} off",
            on["failed"] <= off["failed"] and not on["unfinished"],
        ),
    ]


def main() -> None:
    parser = common.parser(__doc__, redis_db=REDIS_DB)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--flaky", type=int, default=5)
    parser.add_argument("--clusters", type=int, default=200)
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--retry-budget", type=int, default=2)
    args = parser.parse_args()
    if not 0 <= args.flaky <= args.workers or args.size > args.workers - args.flaky:
        parser.error("--flaky must be 0 to --workers, leaving --size healthy workers")
    common.raise_open_files(args.workers)
    common.start(args)
    results = {mode: run_mode(after, args) for mode, after in MODES.items()}
    crashes = sum(len(r["crashes"]) for r in results.values())
    common.finish(
        args,
        "health",
        "## Worker health: quarantine with a flaky share",
        common.table(HEADER, rows(results)),
        [f"Crash lines in daphne's and Celery's logs: {crashes}."],
        figures(results),
        crashed=bool(crashes),
    )


if __name__ == "__main__":
    main()
