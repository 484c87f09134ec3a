"""The dispatch pass over ready clusters x idle workers, and gang-start latency on the real stack.

    .venv/bin/python bench/dispatch.py [--grid 100x500,1000x5000] [--repeat N] [--trials N]
                                       [--history N] [--only pass|gang]
                                       [--write docs/benchmarks.md]

Dispatch pass: C ready clusters of 4 members (2 eval + 2 build) over W connected workers with
live idle slots in 3 zones, written straight into the tables (no sessions: channel_name and
idle_slot rows are set directly), with the in-memory channel layer (no Redis).
`run_pass()` is timed as a whole and, through wrappers around what it calls, piece by piece.
The first grid point runs again with --history finished clusters kept behind the ready ones.

Gang-start latency: a daphne and a Celery worker + beat as subprocesses (dispatch interval left
at 5 s, so the measured path is the wake-up) and reference workers (SimulatedWorker) in this
process. Each trial queues a cluster of 2 to 4 members while only members - 1 seats are idle,
then frees the last worker: from its RequestJob to StartCluster at every member.

It uses its own database (--database, default gradient_bench; created and migrated when
missing, emptied at the start) and Redis database 9.
"""

import argparse
import asyncio
import logging
import random
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

ZONES = ("zone-a", "zone-b", "zone-c")
SCORED = 0.20  # share of (worker, member job) pairs with a score
REDIS_DB = 9
PASS_SECTION = "## Dispatch pass"
GANG_SECTION = "## Gang-start latency"
PASS_TARGET_SECS = 1.0
PASS_TARGETS = ((1000, 5000), (2000, 5000))  # (ready clusters, workers) under PASS_TARGET_SECS
GANG_TARGET_MS = 100.0
# Their names in bench/run, which their summary rows carry.
PASS_BENCH, GANG_BENCH = "dispatch-pass", "gang-start"


# Dispatch pass


def populate(clusters: int, workers: int, history: int = 0) -> dict:
    """Projects, workers (idle slots come with each pass), clusters and scores, in bulk; and
    `history` finished clusters behind the ready ones."""
    from django.db import connection
    from django.utils import timezone

    from clusters.models import ClusterJob, ClusterMember
    from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, Project
    from workers.models import Worker

    rng = random.Random(42)
    now = timezone.now()
    p1, p2 = Project.objects.bulk_create([Project(name="bench-1"), Project(name="bench-2")])
    made = Worker.objects.bulk_create(
        Worker(
            name=f"w-{i}",
            token_hash=f"{i:064x}",
            all_projects=i % 10 != 0,  # a tenth may take jobs of project 1 only
            architectures=["x86_64-linux"] + (["aarch64-linux"] if i % 10 == 5 else []),
            system_features=["kvm"] if i % 4 == 1 else [],
            max_concurrent_builds=1,
            max_concurrent_evals=1,
            can_eval=i % 20 != 7,  # a twentieth builds only
            can_build=True,
            zone=ZONES[i % 3],
            channel_name=f"bench.channel!{i}",
            connected_at=now,
            last_seen_at=now,
        )
        for i in range(workers)
    )
    Worker.projects.through.objects.bulk_create(
        Worker.projects.through(worker_id=w.pk, project_id=p1.pk)
        for i, w in enumerate(made)
        if i % 10 == 0
    )
    # Pins go to distinct workers that could seat them (i = 3 mod 10: any project, evals).
    pin_every = 10
    spacing = max(workers // max(clusters // pin_every, 1), 1)
    # Every cluster was offered to the fleet a while ago (clusters.asking), and a fifth of the
    # pairs answered: the pass places on those scores rather than wait for more.
    offered = timezone.now() - timedelta(minutes=5)
    jobs = ClusterJob.objects.bulk_create(
        ClusterJob(
            project=p1 if i % 2 else p2,
            same_zone=i % 3 == 0,
            prioritized=i % 20 == 0,
            offered_at=offered,
        )
        for i in range(clusters)
    )
    evals = Evaluation.objects.bulk_create(
        Evaluation(project=job.project, prioritized=i % 20 == 0 and n == 0)
        for i, job in enumerate(jobs)
        for n in range(2)
    )
    builds = DerivationBuild.objects.bulk_create(
        DerivationBuild(
            project=job.project,
            status=BuildStatus.QUEUED,
            architecture="aarch64-linux" if i % 20 == 11 and n == 0 else "x86_64-linux",
            required_features=["kvm"] if i % 10 == 4 and n == 1 else [],
            cache_available=rng.random() < 0.1,
        )
        for i, job in enumerate(jobs)
        for n in range(2)
    )
    members = []
    for i, job in enumerate(jobs):
        pin = f"w-{(i // pin_every) * spacing + 3}" if i % pin_every == 0 else None
        members += [
            ClusterMember(cluster_job=job, evaluation=evals[2 * i], role="server", pin=pin),
            ClusterMember(cluster_job=job, evaluation=evals[2 * i + 1], role="server"),
            ClusterMember(cluster_job=job, derivation_build=builds[2 * i], role="client"),
            ClusterMember(cluster_job=job, derivation_build=builds[2 * i + 1], role="client"),
        ]
    ClusterMember.objects.bulk_create(members, batch_size=5000)
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

    from clusters.models import ClusterAttempt, ClusterJob, ClusterMember
    from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, EvaluationStatus

    now = timezone.now()
    for first in range(0, count, 10_000):
        done = ClusterJob.objects.bulk_create(
            ClusterJob(project=project, status="Completed", attempts=1)
            for _ in range(min(10_000, count - first))
        )
        ClusterAttempt.objects.bulk_create(
            ClusterAttempt(
                cluster_job=c, created_at=now, started_at=now, finished_at=now, outcome="Succeeded"
            )
            for c in done
        )
        evals = Evaluation.objects.bulk_create(
            Evaluation(project=project, status=EvaluationStatus.COMPLETED)
            for _ in range(2 * len(done))
        )
        builds = DerivationBuild.objects.bulk_create(
            DerivationBuild(project=project, status=BuildStatus.COMPLETED)
            for _ in range(2 * len(done))
        )
        ClusterMember.objects.bulk_create(
            member
            for i, c in enumerate(done)
            for member in (
                ClusterMember(cluster_job=c, evaluation=evals[2 * i], role="server"),
                ClusterMember(cluster_job=c, evaluation=evals[2 * i + 1], role="server"),
                ClusterMember(cluster_job=c, derivation_build=builds[2 * i], role="client"),
                ClusterMember(cluster_job=c, derivation_build=builds[2 * i + 1], role="client"),
            )
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
    from channels.layers import channel_layers
    from django.conf import settings

    from gradient import heap

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    logging.getLogger("clusters").setLevel(logging.WARNING)  # a line per claim is noise here
    # As a Celery pool process runs the pass (clusters.tasks.tune_heap): with the default
    # collector thresholds, collections over the bench's heap took a fifth of a large pass.
    heap.tune()
    rows = []
    for clusters, workers, history in grid:
        common.ensure_database()
        began = time.monotonic()
        made = populate(clusters, workers, history)
        print(
            f"{clusters}x{workers}, {history} finished: {made['scores']} scores, set up in"
            f" {time.monotonic() - began:.0f} s",
            flush=True,
        )
        runs = []
        for i in range(repeat + 1):  # the first pass warms caches and is not counted
            reset_for_pass()
            target = time_target()
            run = {**time_pass(), "target": target}
            print(
                f"  pass {i}: {run['total']:.3f} s, {run['claimed']}/{run['ready']} claimed"
                + "".join(
                    f", {k} {run[k]:.3f}"
                    for k in ("book", "snapshot", "plan", "claims", "wait", "target")
                ),
                flush=True,
            )
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


PASS_HEADER = [
    "ready clusters x workers",
    "scores",
    "runs",
    "placed",
    "pass median s",
    "pass max s",
    "startable_clusters",
    "snapshot",
    "plan",
    "claims + sends (overlapping)",
    "wait",
    "other",
    "reservation target s",
]


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


PASS_LEAD = (
    "The wall time of one dispatch pass, `run_pass()` (`clusters.dispatch`), over C ready clusters"
    " and W connected idle workers, and its pieces (see `bench/dispatch.py`)."
)


def pass_method(repeat: int) -> list[str]:
    return [
        "Clusters: 4 members each (2 evaluations, 2 builds); a third same_zone, a tenth with a"
        " pinned member; some members need `kvm` or `aarch64-linux`.",
        "Workers: in 3 zones, each with live idle slots of both kinds (builds only for the"
        " twentieth that cannot evaluate); a tenth may take one project only.",
        f"Scores: {SCORED:.0%} of the (worker, member job) pairs have a job_score row (about 4"
        " million at 1,000 x 5,000), vacuumed and checkpointed once written, as autovacuum and"
        " the checkpointer would.",
        "No sessions: rows are written straight into the tables, and the frames go to the"
        " in-memory channel layer, one send per worker (a pass's sends took about 8% of the"
        " process's Python at 2,000 x 5,000; production sends them in one batched Redis call).",
        f"Timed: medians over {repeat} passes after a warm-up pass, each from the same state"
        " (every claim undone, every idle slot fresh), in a process whose collector is set as"
        " a Celery pool process's (`gradient.heap.tune()`).",
        "Pieces, from wrappers around what `run_pass` calls: `startable_clusters` (the book);"
        " `snapshot` (the idle workers); `plan` (producing the placements, waits for scores"
        " included); `claims` (the three claimer threads' time, summed, overlapping the plan);"
        " `wait` (from the last placement to the last claim); other (the advisory lock,"
        " `expire_overdue_prepares`, the reservation pass). The pass is the sum of all but"
        " `claims`.",
        "Reservation target: apart from the pass, before it, `first_target` for the book's"
        " first cluster (clusters.reservation), as a pass computes it for an overdue cluster"
        " when no reservation is active: the planner's match over every connected worker.",
        "Where the time goes: the reader takes the 129 cheapest scores of each member job from"
        " `idx-job_score-job-size` alone (about half a million index entries at 1,000 x 5,000);"
        " once the fleet is nearly full, a cluster its few free workers cannot seat reads no"
        " more; nine clusters in ten are seated without the solver; each batch of 128"
        ' placements is claimed in a handful of set-based statements (docs/design.md, "The'
        ' dispatch pass on five threads").',
        "History: the smallest size again with finished clusters kept behind the ready ones"
        " (Completed, their attempt Succeeded, their four jobs Completed), as a server keeps"
        ' them until retention: the pass reads none of them (docs/design.md, "The cluster'
        " book reads each cluster's own rows\").",
        "Target (issue #18): under 1 s at 1,000 x 5,000 and at 2,000 x 5,000.",
    ]


def pass_section(command: str, rows: list[dict], repeat: int, load: str) -> str:
    body = common.table(PASS_HEADER, [pass_row(r) for r in rows])
    facts = common.run_facts(command, load)
    return common.section_text(PASS_SECTION, PASS_LEAD, pass_method(repeat), facts, body)


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
    from django.db import connection

    from clusters.models import ClusterJob, ClusterStatus
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.models import Project
    from gradient.jobs.submission import JobSpec
    from workers.models import IdleSlot, Worker, hash_token
    from workers.simulator import EventLog, SimulatedWorker, WorkerConfig

    class GatedWorker(LastWorker, SimulatedWorker):
        pass

    def q(fn):
        def run():
            try:
                return fn()
            finally:
                connection.close()

        return sync_to_async(run)()

    # One group of k workers per cluster size k, each with a project of its own so a cluster
    # of one size can never sit on another group's workers: k - 1 take both kinds, the last
    # takes builds only and starts gated.
    quick = WorkerConfig(heartbeat_secs=2.0, job_secs=(0.05, 0.1), backoff=(0.05, 0.5))
    last = WorkerConfig(
        eval=False, max_evals=0, heartbeat_secs=2.0, job_secs=(0.05, 0.1), backoff=(0.05, 0.5)
    )
    log = EventLog(str(log_dir / "workers.jsonl"))
    groups: dict[int, list] = {}

    def make_group(k):
        project = Project.objects.create(name=f"gang-{k}")
        for i in range(k):
            worker = Worker.objects.create(
                name=f"gang-{k}-{i}", token_hash=hash_token(f"t-gang-{k}-{i}"), all_projects=False
            )
            worker.projects.add(project)

    for k in (2, 3, 4):
        await q(lambda k=k: make_group(k))
        groups[k] = [
            SimulatedWorker(f"gang-{k}-{i}", f"t-gang-{k}-{i}", quick, url, log)
            for i in range(k - 1)
        ]
        gated = GatedWorker(f"gang-{k}-{k - 1}", f"t-gang-{k}-{k - 1}", last, url, log)
        gated.gate_init()
        groups[k].append(gated)
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
        fresh = timezone_now() - timedelta(seconds=10)
        return IdleSlot.objects.filter(
            worker__name__in=names, recorded_at__gte=fresh
        ).count() == 2 * len(names)

    def timezone_now():
        from django.utils import timezone

        return timezone.now()

    async def until(check, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not await check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"trial stuck: {check.__name__}")
            await asyncio.sleep(0.02)

    results = []
    try:

        async def all_connected():
            return all(w.connected for w in everyone)

        await until(all_connected)
        for trial in range(trials):
            k = (2, 3, 4)[trial % 3]
            group = groups[k]
            gated = group[-1]
            cluster, _ = await q(lambda k=k: submit_cluster(f"gang-{k}", members(k)))

            async def ready(k=k):
                return all(not w.jobs for w in groups[k]) and await q(lambda: seats_idle(k))

            await until(ready)
            await asyncio.sleep(0.2 + random.random() * 0.1)  # nothing in flight
            marks = {id(w): len(w.events) for w in group}
            freed = await gated.free()

            def started(w, marks=marks):
                return [e for e in list(w.events)[marks[id(w)] :] if e["event"] == "started"]

            async def all_started(group=group, started=started):
                return all(started(w) for w in group)

            await until(all_started, timeout=20.0)

            def first(w, event, marks=marks):
                found = [e for e in list(w.events)[marks[id(w)] :] if e["event"] == event]
                return datetime.fromisoformat(found[0]["time"]).timestamp()

            assigned = max(first(w, "assigned") for w in group) - freed
            start = max(first(w, "started") for w in group) - freed
            results.append({"k": k, "assigned_ms": assigned * 1000, "started_ms": start * 1000})
            print(
                f"  trial {trial}: {k} members, AssignJob at all {assigned * 1000:.1f} ms,"
                f" StartCluster at all {start * 1000:.1f} ms",
                flush=True,
            )

            def done(cluster_id=cluster.pk):
                return ClusterJob.objects.get(pk=cluster_id).status == ClusterStatus.COMPLETED

            async def finished(done=done):
                return await q(done)

            await until(finished)
    finally:
        for w in everyone:
            await w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.close()
    return results


def bench_gang(trials: int) -> dict:
    common.ensure_database()
    env = common.process_env(GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS=5)
    common.flush_redis(env["REDIS_URL"])
    logs = Path(tempfile.mkdtemp(prefix="bench-gang-"))
    procs = common.Processes(env, logs)
    try:
        port = common.free_port()
        procs.daphne(port)
        procs.celery()
        results = asyncio.run(gang_trials(f"ws://127.0.0.1:{port}/proto", trials, logs))
        # Read before the stop: a pool process killed mid-task at shutdown logs a traceback.
        crashed = common.crashes(procs.log_text("daphne")) + common.crashes(
            procs.log_text("celery-worker")
        )
        passes = claiming_passes(procs.log_text("celery-worker"))
    finally:
        procs.stop()
        common.flush_redis(env["REDIS_URL"])
    print(f"logs in {logs}; {len(crashed)} traceback line(s)", flush=True)
    return {"results": results, "crashes": len(crashed), "logs": str(logs), "passes": passes}


def claiming_passes(log: str) -> list[float]:
    """Milliseconds of each dispatch pass that claimed a cluster, from Celery's log."""
    pattern = r"clusters\.dispatch\[[^]]*\] succeeded in ([0-9.]+)s: \{'claimed': [1-9]"
    return [float(x) * 1000 for x in re.findall(pattern, log)]


GANG_HEADER = [
    "members",
    "trials",
    "AssignJob at every member, median ms",
    "p95 ms",
    "StartCluster at every member, median ms",
    "p95 ms",
]


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
                f"{statistics.median(assigned):.1f}",
                f"{common.percentile(assigned, 95):.1f}",
                f"{statistics.median(started):.1f}",
                f"{common.percentile(started, 95):.1f}",
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


GANG_LEAD = (
    "From the RequestJob that completes a placement to StartCluster at every member, on the real"
    " stack (see `bench/dispatch.py`)."
)


def gang_method() -> list[str]:
    return [
        "Stack: daphne (`gradient.serve`), one Celery worker (`-c 2`) and beat as subprocesses on"
        f" the bench database and Redis database {REDIS_DB}. The dispatch interval is left at 5 s,"
        " so the path measured is the wake-up: the RequestJob unanswered, the idle slot recorded,"
        " the dispatch task queued (only while a cluster waits for seats), the pass, the claim,"
        " AssignJob, every AssignJobResponse, StartCluster.",
        "Workers: reference workers (`SimulatedWorker`, real WebSockets) in the script's event"
        " loop, a group per cluster size with a project of its own.",
        "A trial: a cluster of 2, 3 or 4 members (evaluations and builds) while its group's last"
        " worker holds back its RequestJob, so only members - 1 seats are idle; once their idle"
        " slots are recorded, the last worker sends its RequestJob and the clock starts.",
        "A row: times on the workers' one clock, to the latest member's AssignJob and the latest"
        " member's StartCluster; median and p95 over the trials of that size. A member's"
        " acceptance is one statement; the last one's also starts the attempt.",
        f"Target: median under {GANG_TARGET_MS:.0f} ms, over all trials.",
    ]


def gang_section(command: str, gang: dict) -> str:
    facts = [
        *pass_note(gang["passes"]),
        "Consumers or tasks that crashed (`Exception inside application` in daphne's log,"
        f" `raised unexpected` in Celery's): {gang['crashes']}.",
        *common.run_facts(command, gang["load"]),
    ]
    body = common.table(GANG_HEADER, gang_rows(gang["results"]))
    return common.section_text(GANG_SECTION, GANG_LEAD, gang_method(), facts, body)


def pass_note(passes: list[float]) -> list[str]:
    if not passes:
        return []
    return [
        f"The woken dispatch passes that claimed ({len(passes)}, Celery's own timing): median"
        f" {statistics.median(passes):.0f} ms, p95 {common.percentile(passes, 95):.0f} ms."
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default=common.DEFAULT_DATABASE_URL)
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
    parser.add_argument("--write", type=Path, help="update the sections in this markdown file")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/dispatch.py", *sys.argv[1:]])
    common.setup(args.database, REDIS_DB)
    print(command, flush=True)
    if args.only != "gang":
        before = common.load()
        grid = [(c, w, 0) for c, w in args.grid]
        if args.history:
            grid.insert(1, (*args.grid[0], args.history))
        rows = bench_pass(grid, args.repeat)
        load = f"{before} at the start, {common.load()} at the end"
        print(common.table(PASS_HEADER, [pass_row(r) for r in rows]), flush=True)
        if args.write:
            section = pass_section(command, rows, args.repeat, load)
            common.write_section(args.write, PASS_SECTION, section, PASS_BENCH, pass_figures(rows))
    if args.only != "pass":
        before = common.load()
        gang = bench_gang(args.trials)
        gang["load"] = f"{before} at the start, {common.load()} at the end"
        print(common.table(GANG_HEADER, gang_rows(gang["results"])), flush=True)
        if args.write:
            section = gang_section(command, gang)
            figures = gang_figures(gang["results"])
            common.write_section(args.write, GANG_SECTION, section, GANG_BENCH, figures)


if __name__ == "__main__":
    main()
