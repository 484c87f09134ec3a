"""The dispatch pass over ready clusters x idle workers, and gang-start latency on the real stack.

The methods are in docs/benchmarks.md, "Dispatch pass" and "Gang-start latency".
"""

import asyncio
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

ZONES = ("zone-a", "zone-b", "zone-c")
SCORED = 0.20  # share of (worker, member job) pairs with a score
REDIS_DB = 9
PASS_TARGET_SECS = 1.0
PASS_TARGETS = ((1000, 5000), (2000, 5000))  # (ready clusters, workers) under PASS_TARGET_SECS
GANG_TARGET_MS = 100.0


# Dispatch pass


def populate(clusters: int, workers: int, history: int = 0) -> dict:
    """Projects, workers (idle slots come with each pass), clusters and scores, in bulk; and
    `history` finished clusters behind the ready ones."""
    from django.db import connection
    from django.utils import timezone

    from gradient.jobs.models import Project

    rng = random.Random(42)
    p1, p2 = Project.objects.bulk_create([Project(name="bench-1"), Project(name="bench-2")])
    common.make_workers(
        (f"w-{i}" for i in range(workers)),
        lambda i: None if i % 10 else p1,  # a tenth may take jobs of project 1 only
        connected=True,
        each=lambda i: {
            "architectures": ["x86_64-linux"] + (["aarch64-linux"] if i % 10 == 5 else []),
            "system_features": ["kvm"] if i % 4 == 1 else [],
            "can_eval": i % 20 != 7,  # a twentieth builds only
            "zone": ZONES[i % 3],
        },
        max_concurrent_builds=1,
        max_concurrent_evals=1,
        can_build=True,
    )
    # Pins go to distinct workers that could seat them (i = 3 mod 10: any project, evals).
    pin_every = 10
    spacing = max(workers // max(clusters // pin_every, 1), 1)
    # Every cluster was offered to the fleet a while ago (clusters.asking), and a fifth of the
    # pairs answered: the pass places on those scores rather than wait for more.
    offered = timezone.now() - timedelta(minutes=5)

    def shape(i: int) -> tuple[dict, list[tuple]]:
        cluster = {"project": p1 if i % 2 else p2, "same_zone": i % 3 == 0}
        cluster.update(prioritized=i % 20 == 0, offered_at=offered)
        pin = f"w-{(i // pin_every) * spacing + 3}" if i % pin_every == 0 else None
        evals = [("server", "eval", {"prioritized": i % 20 == 0 and n == 0}, {}) for n in range(2)]
        evals[0][3]["pin"] = pin
        builds = [
            (
                "client",
                "build",
                {
                    "architecture": "aarch64-linux" if i % 20 == 11 and n == 0 else "x86_64-linux",
                    "required_features": ["kvm"] if i % 10 == 4 and n == 1 else [],
                    "cache_available": rng.random() < 0.1,
                },
                {},
            )
            for n in range(2)
        ]
        return cluster, evals + builds

    common.make_clusters(shape(i) for i in range(clusters))
    if history:
        keep_history(p1, history)
    with connection.cursor() as cursor:
        cursor.execute("SELECT setseed(0.42)")
        cursor.execute(
            """
            INSERT INTO job_score (worker_id, job_id, offered_at, missing_count,
                                   missing_nar_size, scored_at)
            SELECT w.id, k.key, now(), (random() * 500)::int,
                   (random() * 8 * 1024 * 1024 * 1024)::bigint, now()
            FROM worker w
            CROSS JOIN (SELECT CASE WHEN evaluation_id IS NOT NULL
                                    THEN 'eval:' || evaluation_id::text
                                    ELSE 'build:' || derivation_build_id::text END AS key
                        FROM cluster_member m JOIN cluster_job c ON c.id = m.cluster_job_id
                        WHERE c.status = 'Queued') k
            WHERE random() < %s
            """,
            [SCORED],
        )
        scores = cursor.rowcount
        # As autovacuum leaves it: the visibility map set, so index-only scans stay so.
        cursor.execute("VACUUM ANALYZE job_score")
        cursor.execute("ANALYZE")
        # Millions of rows just written leave the checkpointer flushing them for minutes, and
        # passes timed meanwhile share the disk with it; a service would have long since.
        cursor.execute("CHECKPOINT")
    return {"scores": scores}


def keep_history(project, count: int) -> None:
    """`count` finished clusters as a server keeps them until retention: Completed, their
    attempt Succeeded, their four jobs Completed."""
    from django.utils import timezone

    from clusters.models import ClusterAttempt
    from gradient.jobs.models import BuildStatus, EvaluationStatus

    now = timezone.now()
    done = {"project": project, "status": "Completed", "attempts": 1}
    members = [("server", "eval", {"status": EvaluationStatus.COMPLETED}, {})] * 2
    members += [("client", "build", {"status": BuildStatus.COMPLETED}, {})] * 2
    for first in range(0, count, 10_000):
        made, _ = common.make_clusters([(done, members)] * min(10_000, count - first))
        ClusterAttempt.objects.bulk_create(
            ClusterAttempt(
                cluster_job=c, created_at=now, started_at=now, finished_at=now, outcome="Succeeded"
            )
            for c in made
        )


def reset_for_pass() -> None:
    """Undo the last pass: no attempt, every build Queued, every idle slot fresh."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM dispatched_job")
        cursor.execute("DELETE FROM cluster_attempt WHERE finished_at IS NULL")  # not history's
        cursor.execute("UPDATE derivation_build SET status = 'Queued' WHERE status = 'Building'")
        cursor.execute("UPDATE cluster_job SET status = 'Queued' WHERE status = 'Running'")
        cursor.execute("DELETE FROM idle_slot")
        cursor.execute(
            "INSERT INTO idle_slot (worker_id, kind, recorded_at)"
            " SELECT w.id, k.kind, now() FROM worker w"
            " CROSS JOIN (VALUES ('eval'), ('build')) AS k(kind)"
            " WHERE k.kind = 'build' OR w.can_eval"
        )
        cursor.execute(
            "VACUUM ANALYZE dispatched_job, cluster_attempt, idle_slot, derivation_build,"
            " cluster_job"
        )


class Stopwatch:
    """Wraps the functions run_pass calls, summing each one's wall time. The planner is a
    generator whose placements are claimed in batches on other threads as they come: `plan`
    is the time spent producing placements, `claims` the claimer threads' time on their
    batches, summed (overlapping the plan), `wait` the rest of `_claim_all` (mostly waiting
    for the last batch once the plan is done)."""

    PIECES = {
        "expire": "expire_overdue_prepares",
        "book": "startable_clusters",
        "snapshot": "snapshot",
        "claim_all": "_claim_all",
        "claims": "claim_placements",
    }

    def __init__(self):
        from clusters import dispatch

        self.totals: dict[str, float] = {}
        self.lock = threading.Lock()
        self.saved = []
        for piece, name in self.PIECES.items():
            self._wrap(dispatch, name, piece)
        original = dispatch.planner.placements
        self.saved.append((dispatch.planner, "placements", original))

        def timed_placements(*args, **kwargs):
            placements = original(*args, **kwargs)
            while True:
                began = time.perf_counter()
                try:
                    placement = next(placements)
                except StopIteration:
                    return
                finally:
                    self._add("plan", time.perf_counter() - began)
                yield placement

        dispatch.planner.placements = timed_placements

    def _add(self, piece: str, secs: float) -> None:
        with self.lock:  # the claimer threads add theirs at once
            self.totals[piece] = self.totals.get(piece, 0.0) + secs

    def _wrap(self, module, name, piece):
        original = getattr(module, name)
        self.saved.append((module, name, original))

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(piece, time.perf_counter() - began)

        setattr(module, name, timed)

    def restore(self):
        for module, name, original in self.saved:
            setattr(module, name, original)


def time_pass() -> dict:
    from clusters.dispatch import run_pass

    watch = Stopwatch()
    try:
        began = time.perf_counter()
        result = run_pass()
        total = time.perf_counter() - began
    finally:
        watch.restore()
    pieces = {
        piece: watch.totals.get(piece, 0.0) for piece in ("expire", "book", "snapshot", "plan")
    }
    pieces["claims"] = watch.totals.get("claims", 0.0)
    pieces["wait"] = watch.totals.get("claim_all", 0.0) - pieces["plan"]
    pieces["other"] = total - sum(pieces.values()) + pieces["claims"]
    return {
        "total": total,
        **pieces,
        "ready": result.ready,
        "placed": result.placed,
        "claimed": len(result.claimed),
    }


def time_target() -> float:
    """A reservation's target for the book's first cluster, as an overdue one gets it: over
    every connected worker, busy or idle."""
    from django.utils import timezone

    from clusters.book import startable_clusters
    from clusters.reservation import first_target

    now = timezone.now()
    book = startable_clusters(now)
    began = time.perf_counter()
    if first_target(book[:1], now) is None:
        raise RuntimeError("the bench's first cluster has no reservation target")
    return time.perf_counter() - began


def bench_pass(grid: list[tuple[int, int, int]], repeat: int) -> list[dict]:
    from gradient import heap

    common.in_memory_layer()
    # As a Celery pool process runs the pass (clusters.tasks.tune_heap).
    heap.tune()
    rows = []
    for clusters, workers, history in grid:
        common.ensure_database()
        made = populate(clusters, workers, history)
        runs = []
        for i in range(repeat + 1):  # the first pass warms caches and is not counted
            reset_for_pass()
            target = time_target()
            run = {**time_pass(), "target": target}
            if i:
                runs.append(run)
        rows.append({**summarize_pass(clusters, workers, made["scores"], runs), "history": history})
    return rows


def summarize_pass(clusters: int, workers: int, scores: int, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "clusters": clusters,
        "workers": workers,
        "scores": scores,
        "runs": len(runs),
        "median": med,
        "max": max(r["total"] for r in runs),
    }


PASS_HEADER = (
    "ready clusters x workers | scores | runs | placed | pass median s | pass max s"
    " | startable_clusters | snapshot | plan | claims + sends (overlapping) | wait | other"
    " | reservation target s"
)


def pass_row(r: dict) -> list:
    m = r["median"]
    return [
        f"{r['clusters']:,} x {r['workers']:,}"
        + (f", {r['history']:,} finished behind" if r["history"] else ""),
        f"{r['scores']:,}",
        r["runs"],
        f"{int(m['claimed']):,}",
        f"{m['total']:.3f}",
        f"{r['max']:.3f}",
        *(f"{m[k]:.3f}" for k in ("book", "snapshot", "plan", "claims", "wait")),
        f"{m['other'] + m['expire']:.3f}",
        f"{m['target']:.3f}",
    ]


def pass_figures(rows: list[dict]) -> list[common.Figure]:
    return [
        common.Figure(
            f"dispatch pass, {r['clusters']:,} ready clusters x {r['workers']:,} workers (median)",
            f"< {PASS_TARGET_SECS:g} s",
            f"{r['median']['total']:.3f} s",
            r["median"]["total"] < PASS_TARGET_SECS,
        )
        for r in rows
        if (r["clusters"], r["workers"]) in PASS_TARGETS and not r["history"]
    ]


# Gang-start latency


class LastWorker:
    """Mixin for the SimulatedWorker that completes each placement: its RequestJobs wait
    behind a gate, so the server sees it busy (no idle slot) until the trial frees it."""

    def gate_init(self):
        self.gated = True
        self.pending: list[str] = []

    async def _request(self, kind: str) -> None:
        if self.gated:
            if kind not in self.pending:
                self.pending.append(kind)
            return
        await super()._request(kind)

    async def free(self) -> float:
        """Send the held-back RequestJob(s) now; returns when the first left."""
        self.gated = False
        kinds = self.pending or ["build"]
        self.pending = []
        freed = time.time()
        for kind in kinds:
            await super()._request(kind)
        self.gated = True  # from here on, its next requests wait for the next trial
        return freed


async def gang_trials(url: str, trials: int, log_dir: Path) -> list[dict]:
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from clusters.models import ClusterJob, ClusterStatus
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.models import Project
    from gradient.jobs.submission import JobSpec
    from workers.models import IdleSlot
    from workers.simulator import EventLog, SimulatedWorker, WorkerConfig

    class GatedWorker(LastWorker, SimulatedWorker):
        pass

    def q(fn):
        return sync_to_async(common.closing(fn))()

    async def until(check, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not await check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"trial stuck: {check.__name__}")
            await asyncio.sleep(0.02)

    # One group of k workers per cluster size k, each with a project of its own so a cluster
    # of one size can never sit on another group's workers: k - 1 take both kinds, the last
    # takes builds only and starts gated.
    quick = {"heartbeat_secs": 2.0, "job_secs": (0.05, 0.1), "backoff": (0.05, 0.5)}
    log = EventLog(str(log_dir / "workers.jsonl"))
    groups: dict[int, list] = {}

    def make_group(k: int) -> list[str]:
        names = [f"gang-{k}-{i}" for i in range(k)]
        common.make_workers(names, Project.objects.create(name=f"gang-{k}"))
        return names

    for k in (2, 3, 4):
        *names, last = await q(lambda k=k: make_group(k))
        gated_config = WorkerConfig(eval=False, max_evals=0, **quick)
        groups[k] = [
            SimulatedWorker(n, common.token(n), WorkerConfig(**quick), url, log) for n in names
        ]
        groups[k].append(GatedWorker(last, common.token(last), gated_config, url, log))
        groups[k][-1].gate_init()
    everyone = [w for ws in groups.values() for w in ws]
    tasks = [asyncio.create_task(w.run()) for w in everyone]

    def members(k):
        evals = 1 if k == 2 else 2
        return [MemberSpec(role="server", job=JobSpec(kind="eval")) for _ in range(evals)] + [
            MemberSpec(role="client", job=JobSpec(kind="build")) for _ in range(k - evals)
        ]

    def seats_idle(k) -> bool:
        """Every ungated worker of the group holds a fresh idle slot of both kinds."""
        names = [w.name for w in groups[k][:-1]]
        fresh = timezone.now() - timedelta(seconds=10)
        idle = IdleSlot.objects.filter(worker__name__in=names, recorded_at__gte=fresh)
        return idle.count() == 2 * len(names)

    def events(w, marks, event):
        return [e for e in list(w.events)[marks[id(w)] :] if e["event"] == event]

    def first(w, marks, event):
        return datetime.fromisoformat(events(w, marks, event)[0]["time"]).timestamp()

    async def all_connected():
        return all(w.connected for w in everyone)

    results = []
    try:
        await until(all_connected)
        for trial in range(trials):
            k = (2, 3, 4)[trial % 3]
            group = groups[k]
            cluster, _ = await q(lambda k=k: submit_cluster(f"gang-{k}", members(k)))

            async def ready(k=k):
                return all(not w.jobs for w in groups[k]) and await q(lambda: seats_idle(k))

            async def finished(pk=cluster.pk):
                status = await q(lambda: ClusterJob.objects.get(pk=pk).status)
                return status == ClusterStatus.COMPLETED

            await until(ready)
            await asyncio.sleep(0.2 + random.random() * 0.1)  # nothing in flight
            marks = {id(w): len(w.events) for w in group}
            freed = await group[-1].free()

            async def all_started(group=group, marks=marks):
                return all(events(w, marks, "started") for w in group)

            await until(all_started, timeout=20.0)
            assigned = max(first(w, marks, "assigned") for w in group) - freed
            start = max(first(w, marks, "started") for w in group) - freed
            results.append({"k": k, "assigned_ms": assigned * 1000, "started_ms": start * 1000})
            await until(finished)
    finally:
        for w in everyone:
            await w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.close()
    return results


def bench_gang(trials: int) -> dict:
    common.ensure_database()
    with common.stack("gang", GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS=5) as procs:
        results = asyncio.run(gang_trials(procs.url, trials, procs.logs))
        crashed, _ = procs.problems()
        passes = claiming_passes(procs.log_text("celery-worker"))
    return {"results": results, "crashes": len(crashed), "passes": passes}


def claiming_passes(log: str) -> list[float]:
    """Milliseconds of each dispatch pass that claimed a cluster, from Celery's log."""
    return [r["task_secs"] * 1000 for r in common.passes(log) if r["claimed"]]


GANG_HEADER = (
    "members | trials | AssignJob at every member, median ms | p95 ms"
    " | StartCluster at every member, median ms | p95 ms"
)


def gang_rows(results: list[dict]) -> list[list]:
    rows = []
    for label, subset in [
        *((str(k), [r for r in results if r["k"] == k]) for k in (2, 3, 4)),
        ("all", results),
    ]:
        if not subset:
            continue
        assigned = [r["assigned_ms"] for r in subset]
        started = [r["started_ms"] for r in subset]
        rows.append(
            [
                label,
                len(subset),
                *(
                    f"{common.percentile(xs, p):.1f}"
                    for xs in (assigned, started)
                    for p in (50, 95)
                ),
            ]
        )
    return rows


def gang_figures(results: list[dict]) -> list[common.Figure]:
    if not results:
        return []
    median = statistics.median(r["started_ms"] for r in results)
    return [
        common.Figure(
            "gang start: StartCluster at every member, median of all trials",
            f"< {GANG_TARGET_MS:.0f} ms",
            f"{median:.1f} ms",
            median < GANG_TARGET_MS,
        )
    ]


def pass_note(passes: list[float]) -> list[str]:
    if not passes:
        return []
    return [
        f"The woken dispatch passes that claimed ({len(passes)}, Celery's own timing): median"
        f" {common.percentile(passes, 50):.0f} ms, p95 {common.percentile(passes, 95):.0f} ms."
    ]


def main() -> None:
    parser = common.parser(__doc__, redis_db=REDIS_DB)
    parser.add_argument("--grid", default="100x500,1000x5000,2000x5000", type=common.parse_grid)
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per grid point")
    parser.add_argument(
        "--history",
        type=int,
        default=50_000,
        help="finished clusters kept behind the first grid point, run again (0: none)",
    )
    parser.add_argument("--trials", type=int, default=60, help="gang-start trials")
    parser.add_argument("--only", choices=("pass", "gang"))
    args = parser.parse_args()
    common.start(args)
    if args.only != "gang":
        before = common.load()
        grid = [(c, w, 0) for c, w in args.grid]
        if args.history:
            grid.insert(1, (*args.grid[0], args.history))
        rows = bench_pass(grid, args.repeat)
        table = common.table(PASS_HEADER, [pass_row(r) for r in rows])
        load = common.load_span(before)
        common.finish(
            args, "dispatch-pass", "## Dispatch pass", table, load=load, figures=pass_figures(rows)
        )
    if args.only != "pass":
        before = common.load()
        gang = bench_gang(args.trials)
        common.finish(
            args,
            "gang-start",
            "## Gang-start latency",
            common.table(GANG_HEADER, gang_rows(gang["results"])),
            [*pass_note(gang["passes"]), common.crash_fact(gang["crashes"])],
            gang_figures(gang["results"]),
            load=common.load_span(before),
            crashed=bool(gang["crashes"]),
        )


if __name__ == "__main__":
    main()
