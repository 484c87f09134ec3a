"""The deep queue: builds per second with 500 and 20,000 builds queued, and the depth's cost.

The method is in docs/benchmarks.md, "Deep queue". The job_score bound uses
GRADIENT_OFFER_WINDOW from the environment (default 32), which the servers started here read.
"""

import io
import json
import os
import statistics
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 13
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_queue_depth"
PROJECT = "qd-builds"
TARGET_RATE = 150.0  # builds per second, at every depth
TARGET_SPREAD = 0.10  # the depths' rates within 10% of each other
OFFER_WINDOW = int(os.environ.get("GRADIENT_OFFER_WINDOW", "32"))
OBSERVE_SECS = 1.0  # the sampler's period: backends' CPU and the depth
SHORT_SHARE = 0.01  # the feeder tops up once the queue is this much short of N


def submit(count: int) -> int:
    """Queues `count` builds with the operator command, as many at a time as it takes."""
    from django.core.management import call_command

    from gradient.jobs.management.commands.submit_job import MAX_COUNT

    made = 0
    while made < count:
        n = min(MAX_COUNT, count - made)
        out = io.StringIO()
        call_command(
            "submit_job", "--project", PROJECT, "--kind", "build", "--count", str(n), stdout=out
        )
        made += len(json.loads(out.getvalue())["job_ids"])
    return made


def queued() -> int:
    from gradient.jobs.models import BuildStatus, DerivationBuild

    return DerivationBuild.objects.filter(project__name=PROJECT, status=BuildStatus.QUEUED).count()


class DepthFeeder(common.Feeder):
    """Tops the queued builds up to `depth` whenever they are SHORT_SHARE short, every tick;
    keeps every depth it read while measuring (each just before a top-up: the lows)."""

    def __init__(self, depth: int, tick: float):
        super().__init__(tick=tick)
        self.depth = depth
        self.short = max(1, round(depth * SHORT_SHARE))
        self.seen: list[int] = []
        self.backend: int | None = None  # its PostgreSQL backend: the bench's, not the stack's

    def top_up(self) -> None:
        if self.backend is None:
            self.backend = common.backend_pid()
        n = queued()
        if self.measuring:
            self.seen.append(n)
        if self.depth - n >= self.short:
            submit(self.depth - n)


def measure(args, feeder: DepthFeeder, meter: common.CpuMeter) -> dict:
    """The window, sampled from this thread: the backends' CPU and the depth every
    OBSERVE_SECS, job_score at --samples evenly spaced times."""
    from django.utils import timezone

    from gradient.jobs.models import DispatchedJob
    from workers.models import JobScore

    depths, scores = [], []
    step = args.window / (args.samples - 1)
    load_start = common.load()
    feeder.measuring = True
    meter.start()
    since, began = timezone.now(), time.monotonic()
    next_score, end = began, began + args.window
    while True:
        now = time.monotonic()
        if now >= next_score - 0.05:
            scores.append(JobScore.objects.count())
            next_score += step
        depths.append(queued())
        meter.observe()  # the backends that close meanwhile
        if now >= end:
            break
        time.sleep(max(0.0, min(now + OBSERVE_SECS, next_score, end) - time.monotonic()))
    cpu = meter.stop()
    until, secs = timezone.now(), time.monotonic() - began
    feeder.measuring = False
    window = DispatchedJob.objects.filter(finished_at__gte=since, finished_at__lt=until)
    ended = common.count_by(window, "outcome")
    return {
        "window": secs,
        "rate": ended.get("Completed", 0) / secs,
        "failed": ended.get("Failed", 0),
        "abandoned": ended.get("Abandoned", 0),
        "scores": scores,
        "held": depths + feeder.seen,
        "cpu": {name: s / secs for name, s in cpu.items()},  # cores
        "load": f"{load_start} / {common.load()}",
    }


def fleet_command(args, url: str) -> list[str]:
    options = f"--count {args.workers} --prefix qd --no-eval --max-builds 1 --url {url}"
    python = str(common.VENV_BIN / "python")
    return [python, "manage.py", "simulate_workers", *options.split(), "--job-secs", args.job_secs]


def feed_tick(args, depth: int) -> float:
    """Long enough to cost little, short enough that the fleet at its fastest (every slot
    busy, mean job length) takes at most SHORT_SHARE of the queue between two reads."""
    lo, _, hi = args.job_secs.partition("-")
    fastest = args.workers / ((float(lo) + float(hi or lo)) / 2)
    return min(1.0, max(0.02, SHORT_SHARE * depth / fastest))


def wait_connected(args, fleet) -> None:
    def ready():
        if fleet.poll() is not None:
            raise RuntimeError(f"the fleet exited with {fleet.returncode}")
        return common.connected() >= args.workers

    with suppress(TimeoutError):  # measured anyway, with how many were connected
        common.until(ready, args.connect_timeout, "whole fleet", tick=0.2)


def run_one(depth: int, args) -> dict:
    from django.core.management import call_command

    common.ensure_database()
    common.settle(args.settle_load)
    call_command("create_project", PROJECT, stdout=io.StringIO())
    feeder = DepthFeeder(depth, feed_tick(args, depth))
    feeding = threading.Thread(target=feeder.run, name="feeder")
    with common.stack(f"queue-depth-{depth}") as procs:
        submit(depth)
        common.analyze()
        feeding.start()
        fleet = procs.start("fleet", *fleet_command(args, procs.url))
        wait_connected(args, fleet)
        connected = common.connected()
        # Statistics again as the fleet's rows arrive (the database was emptied moments ago).
        common.warm_up(args.warmup)
        own = [p for p in (common.backend_pid(), feeder.backend) if p]  # the bench's
        groups = {**procs.groups(), "fleet": procs.pids("fleet")}
        meter = common.CpuMeter(groups, exclude_backends=own)
        try:
            result = measure(args, feeder, meter)
        finally:
            feeder.stop.set()
            feeding.join()
        if feeder.error is not None:
            raise feeder.error
        result["crashes"], result["tracebacks"] = procs.problems()
    result.update(depth=depth, connected=connected, tick=feeder.tick)
    return result


HEADER = (
    "builds queued (N) | builds completed/s | job_score rows: max / median"
    " | queue held: min / max | jobs failed / abandoned"
    " | cores used: daphne, Celery, PostgreSQL, fleet | load average (start / end)"
)


def rows(results: list[dict], workers: int) -> list[list]:
    out = []
    for r in results:
        cpu = r["cpu"]
        short = "" if r["connected"] == workers else f" ({r['connected']} connected)"
        out.append(
            [
                f"{r['depth']:,}{short}",
                f"{r['rate']:.1f}",
                f"{max(r['scores']):,} / {statistics.median(r['scores']):,.0f}",
                f"{min(r['held']):,} / {max(r['held']):,}",
                f"{r['failed']} / {r['abandoned']}",
                ", ".join(f"{cpu[k]:.2f}" for k in ("daphne", "celery", "postgres", "fleet")),
                r["load"],
            ]
        )
    return out


def figures(results: list[dict], workers: int) -> list[common.Figure]:
    """Issue #18's targets: the rate at every depth, the depths alike, job_score bounded."""
    out = [
        common.Figure(
            f"deep queue: builds completed/s, {r['depth']:,} queued",
            f"≥ {TARGET_RATE:.0f}",
            f"{r['rate']:.1f}",
            r["rate"] >= TARGET_RATE,
        )
        for r in results
    ]
    rates = [r["rate"] for r in results]
    if len(rates) > 1:
        ratio = min(rates) / max(rates) if max(rates) else 0.0
        out.append(
            common.Figure(
                "deep queue: slowest depth's builds/s over the fastest's",
                f"≥ {1 - TARGET_SPREAD:g}",
                f"{ratio:.2f}",
                ratio >= 1 - TARGET_SPREAD,
            )
        )
    most = max(max(r["scores"]) for r in results)
    limit = workers * 2 * OFFER_WINDOW
    target = f"≤ {limit:,} ({workers} workers x 2 x {OFFER_WINDOW})"
    out.append(
        common.Figure("deep queue: job_score rows, the most", target, f"{most:,}", most <= limit)
    )
    return out


def main() -> None:
    parser = common.parser(
        __doc__,
        DATABASE_URL,
        REDIS_DB,
        warmup=10.0,
        window=30.0,
        connect_timeout=120.0,
        settle_load=1.5,
    )
    parser.add_argument("--depths", default="500,20000", help="queued builds, one run each")
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--job-secs", default="0.2-0.6", metavar="LO-HI")
    parser.add_argument("--samples", type=int, default=7, help="job_score counts in the window")
    args = parser.parse_args()
    common.start(args)
    results = [run_one(n, args) for n in common.parse_ints(args.depths)]
    crashes = sum(len(r["crashes"]) for r in results)
    ticks = ", ".join(f"{r['tick']:.2f} s at {r['depth']:,}" for r in results)
    facts = [
        f"The feeder read the queue every {ticks}.",
        common.crash_fact(crashes, sum(r["tracebacks"] for r in results)),
    ]
    common.finish(
        args,
        "queue-depth",
        "## Deep queue",
        common.table(HEADER, rows(results, args.workers)),
        facts,
        figures(results, args.workers),
        load="in the table",
        crashed=bool(crashes),
    )


if __name__ == "__main__":
    main()
