"""Sustained throughput on the real stack: reference workers running short jobs, singles and
clusters mixed, with the queue kept full; how many starts per second, at 100 to 1,000 workers.

Each size runs in a process of its own (this script again, for that size). The method is in
docs/benchmarks.md, "Sustained throughput".
"""

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 11
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_throughput"
# Issue #18's targets: pairs scored per start at every size; member starts per second at 500
# workers (200 remains the aim), and at 1,000 against those at 100.
TARGET_PAIRS_PER_START = 40.0
TARGET_MEMBER_STARTS = {500: 100.0}
AIM_MEMBER_STARTS = 200.0
TARGET_KEPT = (1000, 100, 0.9)  # member starts at 1,000 workers >= 0.9 x those at 100
SINGLES, CLUSTERS = "tp-singles", "tp-clusters"


class Tally:
    """The fleet's starts (their times) and events, counted on its one event loop."""

    def __init__(self):
        self.starts: dict[str, list[float]] = {"member": [], "single": []}
        self.events: Counter = Counter()

    def between(self, kind: str, since: float, until: float) -> int:
        return sum(since <= t < until for t in self.starts[kind])


def counting_worker_class(tally: Tally):
    from gradient.wire.protocol import JobScores
    from workers.simulator import SimulatedWorker

    class CountingWorker(SimulatedWorker):
        singles_only = False  # of the singles' project (set by drive), else of the clusters'

        def _start(self, job):
            super()._start(job)
            self_kind = "member" if job.attempt is not None else "single"
            tally.starts[self_kind].append(time.monotonic())

        async def _on_offer(self, offer):
            tally.events["offered_pairs"] += len(offer.jobs)  # (worker, job) pairs to score
            await super()._on_offer(offer)

        async def _send(self, message):
            sent = await super()._send(message)
            if sent and isinstance(message, JobScores):
                tally.events["scored_pairs"] += len(message.scores)  # the pairs this worker scored
                # A worker takes one project's jobs: the singles' or the clusters' members.
                part = "single" if self.singles_only else "member"
                tally.events[f"scored_{part}_pairs"] += len(message.scores)
            return sent

        def _record(self, event: str, **fields):
            # Only counted: the fleet's own CPU is the bench's too, and a dict and a
            # timestamp per event for 500 workers add up.
            tally.events[event] += 1
            if event == "error":
                self.errors.append(fields)

    return CountingWorker


def make_workers(count: int, single_share: float) -> list[tuple[str, str]]:
    """(name, project) for each worker: a project of its own kind of work."""
    from gradient.jobs.models import Project

    singles = Project.objects.create(name=SINGLES)
    clusters = Project.objects.create(name=CLUSTERS)
    n_single = max(1, round(count * single_share))
    names = [f"tp-{i:04d}" for i in range(count)]
    common.make_workers(names, lambda i: singles if i < n_single else clusters)
    return [(n, SINGLES if i < n_single else CLUSTERS) for i, n in enumerate(names)]


class Feeder(common.Feeder):
    """Keeps both queues full from a thread: every tick, tops the queued single jobs and the
    queued clusters up to their targets. Records the smallest queue it saw in the window."""

    def __init__(self, single_target: int, cluster_target: int, seed: int = 7):
        super().__init__(tick=0.25)
        self.single_target, self.cluster_target = single_target, cluster_target
        self.rng = random.Random(seed)
        self.low = {"singles": None, "clusters": None}  # smallest queue seen while measuring

    def queued(self) -> tuple[int, int]:
        from clusters.models import ClusterJob, ClusterStatus
        from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, EvaluationStatus

        evals = Evaluation.objects.filter(project__name=SINGLES, status=EvaluationStatus.QUEUED)
        builds = DerivationBuild.objects.filter(project__name=SINGLES, status=BuildStatus.QUEUED)
        singles = evals.count() + builds.count()
        clusters = ClusterJob.objects.filter(
            project__name=CLUSTERS, status=ClusterStatus.QUEUED
        ).count()
        return singles, clusters

    def top_up(self) -> None:
        from django.db import transaction

        from clusters.submission import MemberSpec, submit_cluster
        from gradient.jobs.models import Project
        from gradient.jobs.submission import JobSpec, create_jobs

        singles, clusters = self.queued()
        if self.measuring:
            for name, n in (("singles", singles), ("clusters", clusters)):
                if self.low[name] is None or n < self.low[name]:
                    self.low[name] = n
        missing = self.single_target - singles
        if missing > 0:
            specs = [JobSpec(kind=self.rng.choice(("eval", "build"))) for _ in range(missing)]
            with transaction.atomic(durable=True):
                create_jobs(Project.objects.get(name=SINGLES), specs)
        for _ in range(self.cluster_target - clusters):
            k = self.rng.randint(2, 4)
            members = [
                MemberSpec(role="node", job=JobSpec(kind=self.rng.choice(("eval", "build"))))
                for _ in range(k)
            ]
            submit_cluster(CLUSTERS, members)


def outcomes() -> dict:
    from django.db import connection

    from clusters.models import ClusterAttempt
    from gradient.jobs.models import DispatchedJob

    jobs = common.count_by(DispatchedJob.objects.exclude(outcome__isnull=True), "outcome")
    attempts = common.count_by(ClusterAttempt.objects.exclude(outcome__isnull=True), "outcome")
    connection.close()
    return {"jobs": jobs, "attempts": attempts}


async def drive(url: str, rows, args, feeder: Feeder, meter: common.CpuMeter) -> dict:
    from gradient import heap
    from workers.simulator import WorkerConfig

    tally = Tally()
    worker_class = counting_worker_class(tally)
    config = WorkerConfig(job_secs=(args.job_min, args.job_max), max_events=10)
    workers = [worker_class(n, common.token(n), config, url) for n, _ in rows]
    for worker, (_, project) in zip(workers, rows, strict=True):
        worker.singles_only = project == SINGLES

    async def launch(i, w):
        await asyncio.sleep(args.ramp * i / len(workers))
        await w.run()

    # The fleet's process shares the cores with the stack: its collector set as the stack's.
    heap.tune()
    tasks = [asyncio.create_task(launch(i, w)) for i, w in enumerate(workers)]
    feeding = threading.Thread(target=feeder.run, name="feeder")
    feeding.start()
    try:
        began = time.monotonic()
        # An overloaded stack may never have every worker connected at once: measured
        # anyway after the timeout, with how many were (in the table).
        while sum(w.connected for w in workers) < len(workers):
            if time.monotonic() - began > args.connect_timeout:
                break
            await asyncio.sleep(0.1)
        # Statistics, as autovacuum keeps them: the database was emptied moments ago.
        await asyncio.to_thread(common.closing(lambda: common.warm_up(args.warmup)))
        feeder.measuring = True
        connected = sum(w.connected for w in workers)
        await asyncio.to_thread(common.closing(meter.start))
        since = time.monotonic()
        before = dict(tally.events)
        await asyncio.sleep(args.window)
        until = time.monotonic()
        cpu = await asyncio.to_thread(common.closing(meter.stop))
        feeder.measuring = False
        # Before the fleet stops: its disconnects abandon whatever the workers hold.
        ended = await asyncio.to_thread(outcomes)
        during = {k: tally.events[k] - before.get(k, 0) for k in tally.events}
    finally:
        feeder.stop.set()
        await asyncio.to_thread(feeding.join)
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        await asyncio.wait(tasks, timeout=5)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if feeder.error is not None:
        raise feeder.error
    secs = until - since
    members = tally.between("member", since, until)
    singles = tally.between("single", since, until)
    errors = Counter(e.get("code") for w in workers for e in w.errors)
    return {
        "workers": len(workers),
        "connected": connected,
        "window": secs,
        "member_rate": members / secs,
        "single_rate": singles / secs,
        "members": members,
        "singles": singles,
        "offered_rate": during.get("offered_pairs", 0) / secs,
        "scored": during.get("scored_pairs", 0),
        "scored_single": during.get("scored_single_pairs", 0),
        "scored_member": during.get("scored_member_pairs", 0),
        "errors": dict(errors),
        "low": dict(feeder.low),
        "cpu": cpu,
        "outcomes": ended,
    }


def run_one(count: int, args) -> dict:
    common.ensure_database()
    rows = make_workers(count, args.single_share)
    n_single = sum(p == SINGLES for _, p in rows)
    n_cluster = count - n_single
    # Ahead of demand: twice the single slots in queued single jobs, and enough queued clusters
    # (3 members on average) to seat every cluster slot once more.
    feeder = Feeder(single_target=4 * n_single + 20, cluster_target=(2 * n_cluster) // 3 + 10)
    common.settle(args.settle_load)
    load_before = common.load()
    with common.stack(f"throughput-{count}") as procs:
        # This process alone is the fleet, with the feeder thread.
        meter = common.CpuMeter(procs.groups(), this_process="fleet")
        result = asyncio.run(drive(procs.url, rows, args, feeder, meter))
        crashed, result["tracebacks"] = procs.problems()
    result["load"] = f"{load_before} / {common.load()}"
    result["crashes"] = crashed
    result["single_workers"], result["cluster_workers"] = n_single, n_cluster
    return result


HEADER = (
    "workers (singles + clusters) | member starts/s | single starts/s | total starts/s"
    " | pairs offered/s | pairs scored per start | pairs per single start, per member start"
    " | CPU ms per start | jobs failed | prepares failed | smallest queue: singles, clusters"
    " | cores used: daphne, Celery, PostgreSQL, fleet | load average (start / end)"
)


def pairs_per_start(r: dict) -> float:
    return r["scored"] / max(r["members"] + r["singles"], 1)


def figures(results: list[dict]) -> list[common.Figure]:
    """Issue #18's targets, on each size's median over its runs: pairs per start at every
    size, member starts at 500 workers, and at 1,000 against 100."""
    sizes = defaultdict(list)
    for r in results:
        sizes[r["workers"]].append(r)
    pairs = {size: [pairs_per_start(r) for r in runs] for size, runs in sizes.items()}
    starts = {size: [r["member_rate"] for r in runs] for size, runs in sizes.items()}
    worst = max(pairs, key=lambda size: statistics.median(pairs[size]))
    out = [
        common.Figure(
            "throughput: (worker, job) pairs scored per start, every fleet size",
            f"≤ {TARGET_PAIRS_PER_START:.0f}",
            f"{common.median_text(pairs[worst])} at {worst:,} workers (the most)",
            statistics.median(pairs[worst]) <= TARGET_PAIRS_PER_START,
        )
    ]
    for size, least in TARGET_MEMBER_STARTS.items():
        rates = starts.get(size)
        out.append(
            common.Figure(
                f"throughput: member starts/s at {size:,} workers",
                f"≥ {least:.0f} (aim {AIM_MEMBER_STARTS:.0f})",
                "not measured" if rates is None else common.median_text(rates),
                None if rates is None else statistics.median(rates) >= least,
            )
        )
    large, small, share = TARGET_KEPT
    if large in starts and small in starts:
        least = share * statistics.median(starts[small])
        result = f"{statistics.median(starts[large]):.1f} against {least:.1f}"
        if len(starts[large]) > 1 or len(starts[small]) > 1:
            result += " (medians)"
        met = statistics.median(starts[large]) >= least
    else:
        result, met = "not measured", None
    figure = f"throughput: member starts/s at {large:,} workers against {small:,}"
    out.append(common.Figure(figure, f"≥ {share:g} x those at {small:,}", result, met))
    return out


def rows(results: list[dict]) -> list[list]:
    out = []
    for r in sorted(results, key=lambda r: (r["workers"], r.get("run", 1))):
        jobs, attempts = r["outcomes"]["jobs"], r["outcomes"]["attempts"]
        starts = r["member_rate"] + r["single_rate"]
        out.append(
            [
                f"{r['workers']:,} ({r['single_workers']} + {r['cluster_workers']})"
                + ("" if r["connected"] == r["workers"] else f", {r['connected']} connected")
                + (f", run {r['run']}" if "run" in r else ""),
                f"{r['member_rate']:.1f}",
                f"{r['single_rate']:.1f}",
                f"{r['member_rate'] + r['single_rate']:.1f}",
                f"{r['offered_rate']:,.0f}",
                f"{pairs_per_start(r):.1f}",
                f"{r['scored_single'] / max(r['singles'], 1):.1f},"
                f" {r['scored_member'] / max(r['members'], 1):.1f}",
                f"{1000 * sum(r['cpu'].values()) / r['window'] / max(starts, 1e-9):.0f}",
                jobs.get("Failed", 0),
                attempts.get("PrepareFailed", 0),
                f"{r['low']['singles']}, {r['low']['clusters']}",
                ", ".join(
                    f"{r['cpu'][k] / r['window']:.2f}"
                    for k in ("daphne", "celery", "postgres", "fleet")
                ),
                r["load"],
            ]
        )
    return out


def observed(results: list[dict]) -> list[str]:
    abandoned = sum(r["outcomes"]["jobs"].get("Abandoned", 0) for r in results)
    errors = Counter()
    for r in results:
        errors.update(r["errors"])
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "none"
    crashes = sum(len(r["crashes"]) for r in results)
    return [
        f"Assignments abandoned, all sizes: {abandoned}. Error frames the workers got:"
        f" {error_text}.",
        common.crash_fact(crashes, sum(r["tracebacks"] for r in results)),
    ]


def run_alone(count: int) -> dict:
    """One fleet size in a process of its own: the fleet runs in this script's process, and
    what the earlier sizes' fleets left there slowed the next one's (docs/benchmarks.md)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # The caller's own options, then the size and the result file: argparse keeps the
        # last of a repeated option. (A child with --result-to writes no section.)
        extra = ["--fleets", str(count), "--result-to", str(out)]
        argv = [sys.executable, __file__, *sys.argv[1:], *extra]
        subprocess.run(argv, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = common.parser(
        __doc__,
        DATABASE_URL,
        REDIS_DB,
        warmup=15.0,
        window=30.0,
        connect_timeout=180.0,
        settle_load=1.5,
        runs=3,
    )
    # A run takes about a minute plus its connect time and the wait for a calm host.
    parser.add_argument("--fleets", default="100,200,500,1000")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds to connect the fleet")
    parser.add_argument("--single-share", type=float, default=0.2)
    parser.add_argument("--job-min", type=float, default=0.5)
    parser.add_argument("--job-max", type=float, default=1.5)
    parser.add_argument("--result-to", type=Path, help=argparse.SUPPRESS)  # one size's, as JSON
    args = parser.parse_args()
    fleets = common.parse_ints(args.fleets)
    common.start(args)
    if args.result_to is not None or (len(fleets) == 1 and args.runs == 1):
        common.raise_open_files(fleets[0])
        results = [run_one(fleets[0], args)]
        if args.result_to is not None:
            args.result_to.write_text(json.dumps(results[0]))
            return
    else:
        results = []
        for run in range(1, args.runs + 1):
            for n in fleets:
                result = run_alone(n)
                if args.runs > 1:
                    result["run"] = run
                results.append(result)
    common.finish(
        args,
        "throughput",
        "## Sustained throughput",
        common.table(HEADER, rows(results)),
        observed(results),
        figures(results),
        load="in the table",
        crashed=any(r["crashes"] for r in results),
    )


if __name__ == "__main__":
    main()
