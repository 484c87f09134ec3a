"""The dispatch pass over ready clusters x idle workers, and gang-start latency on the real stack.

The methods are in docs/benchmarks.md, "Dispatch pass" and "Gang-start latency".
"""

import ast
import asyncio
import random
import re
import statistics
import sys
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


def populate(clusters: int, workers: int, history: int = 0) -> int:
    """Projects, workers, clusters and scores in bulk, `history` finished clusters behind."""
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
            {
                "architecture": "aarch64-linux" if i % 20 == 11 and n == 0 else "x86_64-linux",
                "required_features": ["kvm"] if i % 10 == 4 and n == 1 else [],
                "cache_available": rng.random() < 0.1,
            }
            for n in range(2)
        ]
        return cluster, evals + [("client", "build", job, {}) for job in builds]

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
    return scores


def keep_history(project, count: int) -> None:
    """`count` finished clusters as a server keeps them until retention."""
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


def time_pass() -> dict:
    """One pass's seconds, and those of its book read (the cost design.md reasons from)."""
    from clusters import dispatch

    book, spent = dispatch.startable_clusters, []

    def timed_book(*args, **kwargs):
        began = time.perf_counter()
        try:
            return book(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    dispatch.startable_clusters = timed_book
    try:
        began = time.perf_counter()
        result = dispatch.run_pass()
        total = time.perf_counter() - began
    finally:
        dispatch.startable_clusters = book
    return {"total": total, "book": sum(spent), "claimed": len(result.claimed)}


def time_target() -> float:
    """A reservation's target for the book's first cluster, as an overdue one gets it."""
    from django.utils import timezone

    from clusters.book import startable_clusters
    from clusters.reservation import first_target

    now = timezone.now()
    book = startable_clusters(now)
    began = time.perf_counter()
    if first_target(book[:1], now) is None:
        raise RuntimeError("the bench's first cluster has no reservation target")
    return time.perf_counter() - began


def bench_pass(grid: list[tuple[int, int, int]], repeat: int) -> list[list]:
    """A table row per grid point: medians over `repeat` timed passes, after one untimed."""
    from gradient import heap

    common.in_memory_layer()
    heap.tune()  # as a Celery pool process runs the pass (clusters.tasks.tune_heap)
    rows = []
    for clusters, workers, history in grid:
        common.ensure_database()
        scores = populate(clusters, workers, history)
        runs = []
        for _ in range(repeat + 1):
            reset_for_pass()
            runs.append({"target": time_target(), **time_pass()})
        runs = runs[1:]  # the first pass warms caches
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        behind = f", {history:,} finished behind" if history else ""
        rows.append(
            [
                f"{clusters:,} x {workers:,}{behind}",
                f"{scores:,}",
                len(runs),
                f"{int(med['claimed']):,}",
                f"{med['total']:.3f}",
                f"{max(r['total'] for r in runs):.3f}",
                f"{med['book']:.3f}",
                f"{med['target']:.3f}",
            ]
        )
    return rows


PASS_HEADER = (
    "ready clusters x workers | scores | runs | placed | pass median s | pass max s"
    " | startable_clusters s | reservation target s"
)


def pass_figures(rows: list[list]) -> list[common.Figure]:
    targets = {f"{c:,} x {w:,}" for c, w in PASS_TARGETS}
    return [
        common.Figure(
            f"dispatch pass, {r[0].replace(' x ', ' ready clusters x ')} workers (median)",
            f"< {PASS_TARGET_SECS:g} s",
            f"{r[4]} s",
            float(r[4]) < PASS_TARGET_SECS,
        )
        for r in rows
        if r[0] in targets
    ]


# Gang-start latency


async def gang_trials(url: str, trials: int, log_dir: Path) -> list[tuple[int, float]]:
    """(members, ms from the last seat's RequestJob to StartCluster at every member) per trial."""
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from clusters.models import ClusterJob, ClusterStatus
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.models import Project
    from gradient.jobs.submission import JobSpec
    from workers.models import IdleSlot
    from workers.simulator import EventLog, SimulatedWorker, WorkerConfig

    class LastWorker(SimulatedWorker):
        """The seat that completes a placement: busy to the server until free()."""

        gated, pending = True, []

        async def _request(self, kind: str) -> None:
            if not self.gated:
                await super()._request(kind)
            elif kind not in self.pending:
                self.pending = [*self.pending, kind]

        async def free(self) -> float:
            self.gated, kinds, self.pending = False, self.pending or ["build"], []
            freed = time.time()
            for kind in kinds:
                await super()._request(kind)
            self.gated = True
            return freed

    def q(fn):
        return sync_to_async(common.closing(fn))()

    async def until(check, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not await check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"trial stuck: {check.__name__}")
            await asyncio.sleep(0.02)

    # A group of k workers per cluster size k, each group with a project of its own: k - 1
    # take both kinds, the last builds only, gated.
    quick = {"heartbeat_secs": 2.0, "job_secs": (0.05, 0.1), "backoff": (0.05, 0.5)}
    log = EventLog(str(log_dir / "workers.jsonl"))
    groups: dict[int, list] = {}
    for k in (2, 3, 4):
        names = [f"gang-{k}-{i}" for i in range(k)]
        await q(
            lambda k=k, names=names: common.make_workers(
                names, Project.objects.create(name=f"gang-{k}")
            )
        )
        groups[k] = [
            SimulatedWorker(n, common.token(n), WorkerConfig(**quick), url, log) for n in names[:-1]
        ]
        gated = WorkerConfig(eval=False, max_evals=0, **quick)
        groups[k].append(LastWorker(names[-1], common.token(names[-1]), gated, url, log))
    everyone = [w for ws in groups.values() for w in ws]
    tasks = [asyncio.create_task(w.run()) for w in everyone]

    def members(k):
        evals = 1 if k == 2 else 2
        return [MemberSpec(role="server", job=JobSpec(kind="eval"))] * evals + [
            MemberSpec(role="client", job=JobSpec(kind="build"))
        ] * (k - evals)

    def seats_idle(k) -> bool:
        names = [w.name for w in groups[k][:-1]]
        fresh = timezone.now() - timedelta(seconds=10)
        idle = IdleSlot.objects.filter(worker__name__in=names, recorded_at__gte=fresh)
        return idle.count() == 2 * len(names)

    def started(w, mark):
        times = [e["time"] for e in list(w.events)[mark:] if e["event"] == "started"]
        return times and datetime.fromisoformat(times[0]).timestamp()

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
            marks = [len(w.events) for w in group]
            freed = await group[-1].free()

            async def all_started(group=group, marks=marks):
                return all(started(w, m) for w, m in zip(group, marks, strict=True))

            await until(all_started, timeout=20.0)
            last = max(started(w, m) for w, m in zip(group, marks, strict=True))
            results.append((k, (last - freed) * 1000))
            await until(finished)
    finally:
        for w in everyone:
            await w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.close()
    return results


def bench_gang(args) -> None:
    before = common.load()
    common.ensure_database()
    with common.stack("gang", GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS=5) as procs:
        results = asyncio.run(gang_trials(procs.url, args.trials, procs.logs))
        crashed, _ = procs.problems()
        # The woken passes that claimed, as Celery logs their result and time.
        found = PASS_LINE.finditer(procs.log_text("celery-worker"))
        passes = [float(m[1]) * 1000 for m in found if ast.literal_eval(m[2])["claimed"]]
    rows = [
        [label, len(ms), f"{common.percentile(ms, 50):.1f}", f"{common.percentile(ms, 95):.1f}"]
        for label, ms in [
            *((str(k), [ms for n, ms in results if n == k]) for k in (2, 3, 4)),
            ("all", [ms for _, ms in results]),
        ]
    ]
    median = common.percentile([ms for _, ms in results], 50)
    figure = common.below(
        "gang start: StartCluster at every member, median of all trials", GANG_TARGET_MS, median
    )
    note = (
        f"The woken dispatch passes that claimed ({len(passes)}, Celery's own timing): median"
        f" {common.percentile(passes, 50):.0f} ms, p95 {common.percentile(passes, 95):.0f} ms."
    )
    common.finish(
        args,
        "gang-start",
        "## Gang-start latency",
        common.table("members | trials | StartCluster at every member, median ms | p95 ms", rows),
        [note, common.crash_fact(len(crashed))],
        [figure],
        load=common.load_span(before),
        crashed=bool(crashed),
    )


# A dispatch pass's result as Celery logs it (clusters.dispatch.PassResult's fields).
PASS_LINE = re.compile(r"clusters\.dispatch\[[^\]]*\] succeeded in ([0-9.]+)s: (\{.*\})")


def main() -> None:
    parser = common.parser(__doc__, redis_db=REDIS_DB)
    parser.add_argument("--grid", default="100x500,1000x5000,2000x5000", type=common.parse_grid)
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per grid point")
    parser.add_argument("--history", type=int, default=50_000, help="behind the first point")
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
        common.finish(
            args,
            "dispatch-pass",
            "## Dispatch pass",
            common.table(PASS_HEADER, rows),
            figures=pass_figures(rows),
            load=common.load_span(before),
        )
    if args.only != "pass":
        bench_gang(args)


if __name__ == "__main__":
    main()
