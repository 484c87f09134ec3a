"""Sustained throughput on the real stack: reference workers running short jobs, singles and
clusters mixed, with the queue kept full; how many starts per second, at 100 to 1,000 workers.

    .venv/bin/python bench/throughput.py [--fleets 100,200,500,1000] [--warmup S]
                                         [--window S] [--write docs/benchmarks.md]

For each fleet size: a fresh bench database and Redis database 11, daphne (gradient.serve), a
Celery worker (-c 2) and beat as subprocesses (like the gang-start bench), and the fleet
(SimulatedWorker over real WebSockets) in this process. A share of the workers (--single-share)
may take jobs of the singles project only, the rest those of the clusters project only: on one
project, a queue kept full of single jobs would leave no idle slot for a cluster to be placed on
(a member is seated only on a worker that asked for a job and got none). A feeder thread keeps
both queues full, ahead of demand, through the project's own submission functions (create_jobs,
submit_cluster): evaluations and builds, and clusters of 2 to 4 members.

Counted in the workers' process: a member start is a StartCluster received for a held member,
a single start an AssignJob of a single job (the worker runs it at once), a scored pair a score
entry of a JobScores the worker sent. Rates are over the steady window that follows the
warm-up. Failures: the workers' JobFailed and refusals, the assignments that ended Failed or
Abandoned and the attempts that ended PrepareFailed (from the database), Error frames the
workers got, and consumers or tasks that crashed (daphne's and Celery's logs).

It uses its own database (--database, default gradient_throughput; created and migrated when
missing, emptied before each fleet size) and Redis database 11.
"""

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 11
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_throughput"
SECTION = "## Sustained throughput"
# Issue #18's targets: pairs scored per start at every size; member starts per second at 500
# workers (200 remains the aim), and at 1,000 against those at 100.
TARGET_PAIRS_PER_START = 40.0
TARGET_MEMBER_STARTS = {500: 100.0}
AIM_MEMBER_STARTS = 200.0
TARGET_KEPT = (1000, 100, 0.9)  # member starts at 1,000 workers >= 0.9 x those at 100
SINGLES, CLUSTERS = "tp-singles", "tp-clusters"


class Tally:
    """Starts and other events counted per kind, with the time of each start, across every
    worker of the fleet (one event loop: no lock needed for the workers; the feeder only
    reads)."""

    def __init__(self):
        self.starts: dict[str, list[float]] = {"member": [], "single": []}
        self.events: Counter = Counter()
        # Where a member's slot spends its time, (when, seconds): from the RequestJob that
        # follows the slot's release to the member's AssignJob, and from that AssignJob to the
        # StartCluster.
        self.waits: dict[str, list[tuple[float, float]]] = {"idle": [], "held": []}

    def between(self, kind: str, since: float, until: float) -> int:
        return sum(since <= t < until for t in self.starts[kind])

    def median_p90(self, what: str, since: float, until: float) -> tuple[float, float] | None:
        secs = sorted(v for t, v in self.waits[what] if since <= t < until)
        if not secs:
            return None
        return statistics.median(secs), secs[min(len(secs) - 1, int(len(secs) * 0.9))]


def counting_worker_class(tally: Tally):
    from gradient.wire.protocol import JobScores
    from workers.simulator import SimulatedWorker

    class CountingWorker(SimulatedWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.free_since: dict[str, float] = {}  # kind -> the first RequestJob since free
            self.assigned_at: dict[str, float] = {}  # held member's job id -> its AssignJob

        def _start(self, job):
            super()._start(job)
            self_kind = "member" if job.attempt is not None else "single"
            tally.starts[self_kind].append(time.monotonic())

        async def _request(self, kind):
            if self.connected and not self.draining:
                self.free_since.setdefault(kind, time.monotonic())  # resends keep the first
            await super()._request(kind)

        async def _on_assign(self, assign):
            now = time.monotonic()
            since = self.free_since.pop(assign.job.kind, None)
            if assign.cluster is not None:
                self.assigned_at[assign.job_id] = now
                if since is not None:
                    tally.waits["idle"].append((now, now - since))
            await super()._on_assign(assign)

        async def _on_start(self, start):
            now = time.monotonic()
            for job in self.held:
                at = self.assigned_at.pop(job.job_id, None)
                if job.attempt == start.attempt and at is not None:
                    tally.waits["held"].append((now, now - at))
            await super()._on_start(start)

        async def _on_offer(self, offer):
            tally.events["offered_pairs"] += len(offer.jobs)  # (worker, job) pairs to score
            await super()._on_offer(offer)

        async def _send(self, message):
            sent = await super()._send(message)
            if sent and isinstance(message, JobScores):
                tally.events["scored_pairs"] += len(message.scores)  # the pairs this worker scored
            return sent

        def _record(self, event: str, **fields):
            # Only counted: the fleet's own CPU is the bench's too, and a dict and a
            # timestamp per event for 500 workers add up.
            tally.events[event] += 1
            if event == "error":
                self.errors.append(fields)

    return CountingWorker


def make_workers(count: int, single_share: float) -> list[tuple[str, str, str]]:
    """(name, token, project) for each worker: a project of its own kind of work."""
    from gradient.jobs.models import Project
    from workers.models import Worker, hash_token

    singles = Project.objects.create(name=SINGLES)
    clusters = Project.objects.create(name=CLUSTERS)
    n_single = max(1, round(count * single_share))
    rows = []
    for i in range(count):
        project = SINGLES if i < n_single else CLUSTERS
        rows.append((f"tp-{i:04d}", f"tp-token-{i}", project))
    made = Worker.objects.bulk_create(
        Worker(name=n, token_hash=hash_token(t), all_projects=False) for n, t, _ in rows
    )
    through = Worker.projects.through
    through.objects.bulk_create(
        through(worker_id=w.pk, project_id=(singles if p == SINGLES else clusters).pk)
        for w, (_, _, p) in zip(made, rows, strict=True)
    )
    return rows


class Feeder(common.Feeder):
    """Keeps both queues full from a thread: every tick, tops the queued single jobs and the
    queued clusters up to their targets. Records the smallest queue it saw in the window."""

    def __init__(self, single_target: int, cluster_target: int, seed: int = 7):
        super().__init__(tick=0.25)
        self.single_target, self.cluster_target = single_target, cluster_target
        self.rng = random.Random(seed)
        self.submitted = Counter()
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
            self.submitted["singles"] += missing
        for _ in range(self.cluster_target - clusters):
            k = self.rng.randint(2, 4)
            members = [
                MemberSpec(role="node", job=JobSpec(kind=self.rng.choice(("eval", "build"))))
                for _ in range(k)
            ]
            submit_cluster(CLUSTERS, members)
            self.submitted["clusters"] += 1
            self.submitted["members"] += k


def closing(fn):
    """fn, then the calling thread's database connection closed: for asyncio.to_thread."""

    def run():
        from django.db import connection

        try:
            return fn()
        finally:
            connection.close()

    return run


def outcomes() -> dict:
    from django.db import connection
    from django.db.models import Count

    from clusters.models import ClusterAttempt
    from gradient.jobs.models import DispatchedJob

    jobs = dict(
        DispatchedJob.objects.exclude(outcome__isnull=True)
        .values_list("outcome")
        .annotate(n=Count("id"))
    )
    attempts = dict(
        ClusterAttempt.objects.exclude(outcome__isnull=True)
        .values_list("outcome")
        .annotate(n=Count("id"))
    )
    connection.close()
    return {"jobs": jobs, "attempts": attempts}


async def drive(url: str, rows, args, feeder: Feeder, meter: common.CpuMeter) -> dict:
    from gradient import heap
    from workers.simulator import WorkerConfig

    tally = Tally()
    worker_class = counting_worker_class(tally)
    config = WorkerConfig(job_secs=(args.job_min, args.job_max), max_events=10)
    workers = [worker_class(n, t, config, url) for n, t, _ in rows]

    async def launch(i, w):
        await asyncio.sleep(args.ramp * i / len(workers))
        await w.run()

    # The fleet's process shares the cores with the stack: its collector set as the stack's.
    heap.settle()
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
        connected_after = time.monotonic() - began
        # Statistics, as autovacuum keeps them on a database in use: this one was emptied
        # moments ago, and with row estimates of 1 PostgreSQL plans the candidates' anti-join
        # on dispatched_job as a scan of every open row per job (50 ms instead of 1).
        await asyncio.to_thread(closing(common.analyze))
        await asyncio.sleep(args.warmup / 2)
        await asyncio.to_thread(closing(common.analyze))
        await asyncio.sleep(args.warmup / 2)
        feeder.measuring = True
        connected = sum(w.connected for w in workers)
        await asyncio.to_thread(closing(meter.start))
        since = time.monotonic()
        before = dict(tally.events)
        await asyncio.sleep(args.window)
        until = time.monotonic()
        cpu = await asyncio.to_thread(closing(meter.stop))
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
        "connected_after": connected_after,
        "connected": connected,
        "window": secs,
        "member_rate": members / secs,
        "single_rate": singles / secs,
        "members": members,
        "singles": singles,
        "offered_rate": during.get("offered_pairs", 0) / secs,
        "scored": during.get("scored_pairs", 0),
        "idle": tally.median_p90("idle", since, until),
        "held": tally.median_p90("held", since, until),
        "failed": during.get("failed", 0),
        "rejected": during.get("rejected", 0),
        "released": during.get("released_hold", 0),
        "errors": dict(errors),
        "low": dict(feeder.low),
        "cpu": cpu,
        "outcomes": ended,
    }


def run_one(count: int, args) -> dict:
    common.ensure_database()
    rows = make_workers(count, args.single_share)
    n_single = sum(p == SINGLES for _, _, p in rows)
    n_cluster = count - n_single
    # Ahead of demand: twice the single slots in queued single jobs, and enough queued clusters
    # (3 members on average) to seat every cluster slot once more.
    feeder = Feeder(single_target=4 * n_single + 20, cluster_target=(2 * n_cluster) // 3 + 10)
    env = common.process_env()
    common.flush_redis(env["REDIS_URL"])
    logs = Path(tempfile.mkdtemp(prefix=f"bench-throughput-{count}-"))
    procs = common.Processes(env, logs)
    load_before = common.load()
    try:
        port = common.free_port()
        procs.daphne(port)
        procs.celery()
        url = f"ws://127.0.0.1:{port}/proto"
        groups = {
            "daphne": procs.pids("daphne"),
            "celery": procs.pids("celery-worker", "celery-beat"),
        }
        # This process alone is the fleet, with the feeder thread.
        meter = common.CpuMeter(groups, this_process="fleet")
        result = asyncio.run(drive(url, rows, args, feeder, meter))
        # Read before the stop: a pool process killed mid-task at shutdown logs a traceback.
        crashed, result["tracebacks"] = common.log_problems(procs)
    finally:
        procs.stop()
        common.flush_redis(env["REDIS_URL"])
    result["load"] = f"{load_before} / {common.load()}"
    result["crashes"] = crashed
    result["single_workers"], result["cluster_workers"] = n_single, n_cluster
    result["submitted"] = dict(feeder.submitted)
    result["logs"] = str(logs)
    print(
        f"{count} workers: {result['member_rate']:.1f} member starts/s,"
        f" {result['single_rate']:.1f} single starts/s over {result['window']:.1f} s"
        f" (load {result['load']}); CPU s in the window: {cpu_text(result['cpu'])};"
        f" {len(crashed)} crash line(s), logs in {logs}",
        flush=True,
    )
    for line in crashed[:5]:
        print("  " + line, flush=True)
    return result


def spread_text(pair) -> str:
    return "-" if pair is None else f"{pair[0]:.1f} / {pair[1]:.1f}"


def cpu_text(cpu: dict) -> str:
    return ", ".join(f"{name} {secs:.1f}" for name, secs in cpu.items())


HEADER = [
    "workers (singles + clusters; connected at the window's start if not all)",
    "member starts/s",
    "single starts/s",
    "total starts/s",
    "(worker, job) pairs offered/s",
    "(worker, job) pairs scored per start",
    "CPU ms per start",
    "member slot: RequestJob to AssignJob s (median / p90)",
    "member slot: AssignJob to StartCluster s (median / p90)",
    "jobs failed",
    "prepares failed",
    "smallest queue: singles, clusters",
    "cores used: daphne, Celery, PostgreSQL, fleet",
    "load average (start / end)",
    "target",
]


def pairs_per_start(r: dict) -> float:
    return r["scored"] / max(r["members"] + r["singles"], 1)


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def target_text(r: dict, results: list[dict]) -> str:
    """The issue's targets that apply to this fleet size, each met or not."""
    met = mark(pairs_per_start(r) <= TARGET_PAIRS_PER_START)
    out = [f"≤ {TARGET_PAIRS_PER_START:.0f} pairs scored/start {met}"]
    least = TARGET_MEMBER_STARTS.get(r["workers"])
    if least is not None:
        met = mark(r["member_rate"] >= least)
        out.append(f"≥ {least:.0f} member starts/s {met} (aim {AIM_MEMBER_STARTS:.0f})")
    large, small, share = TARGET_KEPT
    base = next((b for b in results if b["workers"] == small), None)
    if r["workers"] == large and base is not None:
        least = share * base["member_rate"]
        met = mark(r["member_rate"] >= least)
        out.append(f"member starts/s ≥ {share:g} x those at {small:,} = {least:.1f} {met}")
    return "; ".join(out)


def rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        jobs, attempts = r["outcomes"]["jobs"], r["outcomes"]["attempts"]
        starts = r["member_rate"] + r["single_rate"]
        out.append(
            [
                f"{r['workers']:,} ({r['single_workers']} + {r['cluster_workers']})"
                + ("" if r["connected"] == r["workers"] else f", {r['connected']} connected"),
                f"{r['member_rate']:.1f}",
                f"{r['single_rate']:.1f}",
                f"{r['member_rate'] + r['single_rate']:.1f}",
                f"{r['offered_rate']:,.0f}",
                f"{pairs_per_start(r):.1f}",
                f"{1000 * sum(r['cpu'].values()) / r['window'] / max(starts, 1e-9):.0f}",
                spread_text(r["idle"]),
                spread_text(r["held"]),
                jobs.get("Failed", 0),
                attempts.get("PrepareFailed", 0),
                f"{r['low']['singles']}, {r['low']['clusters']}",
                ", ".join(
                    f"{r['cpu'][k] / r['window']:.2f}"
                    for k in ("daphne", "celery", "postgres", "fleet")
                ),
                r["load"],
                target_text(r, results),
            ]
        )
    return out


def section(command: str, results: list[dict], args) -> str:
    small = min(results, key=lambda r: r["workers"])
    large = max(results, key=lambda r: r["workers"])

    def per_start(r: dict, value: float) -> float:
        return value / max(r["member_rate"] + r["single_rate"], 1e-9)

    pairs_small, pairs_large = pairs_per_start(small), pairs_per_start(large)
    cpu_small = per_start(small, 1000 * sum(small["cpu"].values()) / small["window"])
    crashes = sum(len(r["crashes"]) for r in results)
    tracebacks = sum(r["tracebacks"] for r in results)
    abandoned = sum(r["outcomes"]["jobs"].get("Abandoned", 0) for r in results)
    errors = Counter()
    for r in results:
        errors.update(r["errors"])
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "none"
    return (
        f"{SECTION}\n\n"
        "Reference workers (`SimulatedWorker`, real WebSockets, in the script's process) running"
        f" short jobs ({args.job_min:g} to {args.job_max:g} s, one eval and one build slot"
        " each) on the real stack: daphne (`gradient.serve`, one process per core), one"
        " Celery worker (`-c 2`) and beat as subprocesses, on a database and Redis database"
        " 11 of the bench's own, all started afresh for each fleet size. A share of the workers"
        f" ({args.single_share:.0%}) takes single jobs of one project, the rest cluster"
        " members of another: a queue kept full of singles on one project would leave no idle"
        " slot for any cluster to be placed on. A feeder thread keeps both queues full through"
        " `create_jobs` and `submit_cluster` (evaluations and builds; clusters of 2 to 4"
        " members), topped up every 0.25 s: the smallest queue seen during the window is in its"
        " column. A member start is a StartCluster received for a held member, a single start"
        " an AssignJob of a single job; rates are over a"
        f" {args.window:g} s window after {args.warmup:g} s of warm-up (with an `ANALYZE`"
        " at its start and middle: the database was emptied moments before, and until"
        " autovacuum's first round PostgreSQL plans on row estimates of 1). Jobs failed are"
        " assignments that ended Failed; prepares failed, attempts that ended PrepareFailed;"
        " both, and the assignments abandoned (all sizes:"
        f" {abandoned}), counted from the start to the end of the window. Error frames the"
        f" workers got: {error_text}. Consumers or tasks that crashed (`Exception inside"
        f" application` in daphne's log, `raised unexpected` in Celery's): {crashes};"
        f" tracebacks of any kind there: {tracebacks}. Cores used: CPU seconds per second of"
        " the window, read from `/proc` (daphne; the Celery worker, its pool and beat; the"
        " PostgreSQL backends serving the bench database; this process, the fleet and the"
        " feeder). Where the time goes: everything runs on the same 2 cores, shared with other"
        " work (the load average), and the cores are full at every size; the CPU per start in"
        " its column is the whole stack's. Two things make it. The offers: every job is offered"
        " to and scored by each worker that may take it, and with the queue kept full a job"
        " waits longer than the 10 s within which every worker asks again, so each member job"
        " is scored by nearly every worker of the clusters' project (the pairs scored per"
        " start, the score entries of the JobScores the workers sent in the window over the"
        f" starts in it: {pairs_small:.0f} pairs per start at {small['workers']} workers,"
        f" {pairs_large:.0f} at {large['workers']}); the section Offer pairs measures what one"
        " pair costs at least, 21 to 28 µs of CPU over two runs. And the start itself: at"
        f" {small['workers']} workers, {cpu_small:.0f} ms of CPU per start of which the pairs"
        " are a small part. On saturated cores each start's work waits its turn: the two slot"
        " columns are where a member's slot spends its time, waiting for the AssignJob of a"
        " member after its RequestJob, then holding it until every member of its attempt"
        " accepted and StartCluster came (the job then runs 0.5 to 1.5 s). Where those waits"
        " are seconds, the slots are idle or held most of the time while the cores are full,"
        " so the member starts grow with the cores, not with the slots: 200 member starts a"
        " second at 500 workers would mean about 80,000 pairs a"
        " second (400 workers may take each member), 1.7 to 2.2 cores for the pairs, on top of"
        " the starts' own work. This table's runs have, since the previous one (2026-12-01"
        " 15:23 UTC, reference loop 0.14 s: 67.9 member starts a second at 100 workers, 36.5 at"
        " 500), job_score keyed by its pair, list parameters as array literals, the garbage"
        " collector set for long-running processes and the job rows' active_member flag"
        " (docs/design.md). From run to run the rates spread widely at the larger sizes: the"
        " full run before this one, of the same code a quarter of an hour earlier, had 23.2"
        " member starts a second at 500 workers. Earlier history (the"
        " acceptances that queued behind offers, the AssignJobs a full channel-layer inbox"
        " dropped) is in docs/design.md and docs/reliability.md."
        f" Targets (issue #18): at most {TARGET_PAIRS_PER_START:.0f} pairs scored per start at"
        f" every fleet size; at least {TARGET_MEMBER_STARTS[500]:.0f} member starts per second"
        f" at 500 workers ({AIM_MEMBER_STARTS:.0f} remains the aim), and at {TARGET_KEPT[0]:,}"
        f" workers at least {TARGET_KEPT[2]:g} x those at {TARGET_KEPT[1]}.\n\n"
        f"- Command: `{command}`\n- Date: {common.now_line()}\n"
        f"- Machine: {common.machine()} on the same host over TCP, shared with other work"
        " (load average in the table)\n\n" + common.table(HEADER, rows(results)) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default=DATABASE_URL)
    # A size takes about a minute (62 s at 100 workers: set-up, ramp, warm-up, window) plus
    # its connect time, so four take 5 minutes or so; 300 and 400 made room for 1,000.
    parser.add_argument("--fleets", default="100,200,500,1000")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds to connect the fleet")
    parser.add_argument("--single-share", type=float, default=0.2)
    parser.add_argument(
        "--connect-timeout", type=float, default=180.0, help="seconds to wait for the fleet"
    )
    parser.add_argument("--job-min", type=float, default=0.5)
    parser.add_argument("--job-max", type=float, default=1.5)
    parser.add_argument("--write", type=Path, help="update the section in this markdown file")
    args = parser.parse_args()
    fleets = [int(n) for n in args.fleets.split(",")]
    command = shlex.join([".venv/bin/python", "bench/throughput.py", *sys.argv[1:]])
    common.raise_open_files(max(fleets))
    common.setup(args.database, REDIS_DB)
    print(command, flush=True)
    results = [run_one(n, args) for n in fleets]
    common.finish(
        HEADER,
        rows(results),
        args.write,
        SECTION,
        lambda: section(command, results, args),
        crashed=any(r["crashes"] for r in results),
    )


if __name__ == "__main__":
    main()
